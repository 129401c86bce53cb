//! [`BlkBackend`]: the [`VhostUserBackend`] of one device. vhost-user-backend runs the
//! protocol (one thread for the socket's messages, one epoll thread per entry of
//! [`VhostUserBackend::queues_per_thread`]: here each queue its own thread); this serves the
//! kicks of a queue: pop every available chain, serve it ([`crate::request`]), put it on the
//! used ring, signal the front end unless event-idx suppression says it needs no call, and
//! with event-idx re-enable notification and look again so no chain is left behind.
//!
//! Guest memory: the handler swaps the memory table in the [`GuestMemoryAtomic`] this backend
//! shares with it; each batch takes one snapshot of it (`memory()`), so a table that changes
//! under I/O replaces the regions for the next batch while the current one keeps the old
//! mappings alive. Nothing keeps a pointer into guest memory across batches.
//!
//! After every table change each queue thread looks at its ring again (a rescan event of
//! its own, registered with its epoll loop, written by [`VhostUserBackend::update_memory`]):
//! a kick is asynchronous to the socket, so a front end that posts into new memory and kicks
//! without waiting for SET_MEM_TABLE's reply may have its kick served against the old table
//! (nothing new there), and no other kick would come.
//!
//! Inflight tracking ([`crate::inflight`]): once the front end set an inflight region, each
//! queue's worker holds its part; a chain is marked when popped and cleared after it is on
//! the used ring. The first time a queue is served after the region was set it resubmits
//! the chains still marked (a crashed backend's), in the order they were popped, through a
//! [`Replay`], and sets the next chain to pop to the used index plus those.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use thinpool_frontend::Target;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::Backend;
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_FLUSH;
use virtio_queue::{DescriptorChain, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::config::{self, QUEUE_SIZE_MAX};
use crate::inflight::{QueueLog, Region};
use crate::replay::Replay;
use crate::request::Worker;

/// Guest memory as the handler keeps it.
pub type Memory = GuestMemoryAtomic<GuestMemoryMmap>;

/// The backend of one vhost-user-blk device (one socket). Cloned into the daemon; the
/// clones share everything.
#[derive(Clone)]
pub struct BlkBackend {
    inner: Arc<Inner>,
}

struct Inner {
    target: Arc<dyn Target>,
    queues: u16,
    /// How long a queue thread keeps looking at its ring for more chains after it ran dry,
    /// before it re-enables notifications and sleeps (zero: it sleeps at once).
    poll: Duration,
    mem: Memory,
    acked: AtomicU64,
    /// One worker per queue thread: its buffer (only its thread locks it).
    workers: Vec<Mutex<Worker>>,
    /// Per queue thread, the event that makes it exit (written at shutdown).
    exits: Vec<(Mutex<Option<EventConsumer>>, EventNotifier)>,
    /// Per queue thread, the event that makes it look at its ring again (written after a
    /// memory table change).
    rescans: Vec<(EventConsumer, EventNotifier)>,
    /// The backend-request channel the front end gave us (vhost's sender), held open while
    /// connected: `virtio_uml` breaks the device when it closes. The capacity-change
    /// message goes out on the relay's duplicate of its socket (`crate::capacity`).
    backend_req: Mutex<Option<Backend>>,
}

impl BlkBackend {
    /// A backend serving `target` with `queues` queues (1..=[`config::QUEUES_MAX`]) over
    /// `mem`, each queue thread polling its ring for `poll` before it sleeps.
    pub fn new(
        target: Arc<dyn Target>,
        queues: u16,
        poll: Duration,
        mem: Memory,
    ) -> io::Result<Self> {
        assert!(
            (1..=config::QUEUES_MAX).contains(&queues),
            "{queues} queues"
        );
        let mut exits = Vec::new();
        let mut rescans = Vec::new();
        for _ in 0..queues {
            let (consumer, notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK)?;
            exits.push((Mutex::new(Some(consumer)), notifier));
            rescans.push(new_event_consumer_and_notifier(EventFlag::NONBLOCK)?);
        }
        Ok(BlkBackend {
            inner: Arc::new(Inner {
                target,
                queues,
                poll,
                mem,
                acked: AtomicU64::new(0),
                workers: (0..queues)
                    .map(|_| Mutex::new(Worker::new(false)))
                    .collect(),
                exits,
                rescans,
                backend_req: Mutex::new(None),
            }),
        })
    }

    /// The epoll data of the rescan event: past the range vhost-user-backend reserves for a
    /// thread's rings and its exit event (0 to the thread's ring count, here 1).
    fn rescan_event(&self) -> u16 {
        self.inner.queues + 1
    }

    /// Registers each queue thread's rescan event with its epoll loop (`daemon`'s handlers,
    /// one per thread in the order of [`VhostUserBackend::queues_per_thread`]).
    pub fn register_rescans(&self, daemon: &VhostUserDaemon<BlkBackend>) -> io::Result<()> {
        let handlers = daemon.get_epoll_handlers();
        assert_eq!(
            handlers.len(),
            self.inner.rescans.len(),
            "one handler per thread"
        );
        for (handler, (consumer, _)) in handlers.iter().zip(&self.inner.rescans) {
            handler.register_listener(
                consumer.as_raw_fd(),
                EventSet::IN,
                u64::from(self.rescan_event()),
            )?;
        }
        Ok(())
    }

    /// Serves what is available on the queues of thread `thread_id` after a rescan event.
    fn rescan(&self, vrings: &[VringRwLock], thread_id: usize) -> io::Result<()> {
        let (consumer, _) = self
            .inner
            .rescans
            .get(thread_id)
            .ok_or_else(|| io::Error::other(format!("no rescan event {thread_id}")))?;
        match consumer.consume() {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        let mut worker = self.inner.workers[thread_id]
            .lock()
            .map_err(|_| io::Error::other("a worker panicked"))?;
        // This thread's rings (vhost-user-backend passes only those), each served as a kick
        // would be: only when enabled and ready.
        for vring in vrings {
            let live = {
                let state = vring.get_ref();
                state.is_enabled() && state.get_queue().ready()
            };
            if live {
                self.serve_queue(vring, &mut worker)?;
            }
        }
        Ok(())
    }

    /// Tells every queue thread to exit.
    pub fn exit_all(&self) {
        for (_, notifier) in &self.inner.exits {
            let _ = notifier.notify();
        }
        if let Ok(mut held) = self.inner.backend_req.lock() {
            *held = None;
        }
    }

    /// Serves every chain available on `vring` with `worker`. Notifications stay off while
    /// the thread serves and polls (the driver need not kick); they are re-enabled before it
    /// sleeps, then the ring is looked at once more so that no chain is left behind.
    fn serve_queue(&self, vring: &VringRwLock, worker: &mut Worker) -> io::Result<()> {
        self.resubmit(vring, worker)?;
        loop {
            vring.disable_notification().map_err(to_io)?;
            self.serve_available(vring, worker)?;
            if self.inner.poll > Duration::ZERO {
                let mut deadline = Instant::now() + self.inner.poll;
                while Instant::now() < deadline {
                    if self.has_available(vring) {
                        self.serve_available(vring, worker)?;
                        deadline = Instant::now() + self.inner.poll;
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
            if !vring.enable_notification().map_err(to_io)? {
                return Ok(());
            }
            // More chains arrived while notifications were off: serve them too.
        }
    }

    /// Whether the driver has made chains available that were not served yet.
    fn has_available(&self, vring: &VringRwLock) -> bool {
        let mem = self.inner.mem.memory();
        let state = vring.get_ref();
        let queue = state.get_queue();
        queue.ready()
            && queue
                .avail_idx(&*mem, Ordering::Acquire)
                .is_ok_and(|idx| idx.0 != queue.next_avail())
    }

    fn serve_available(&self, vring: &VringRwLock, worker: &mut Worker) -> io::Result<()> {
        let mem = self.inner.mem.memory();
        let mut served = false;
        loop {
            let chain = vring
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(mem.clone());
            let Some(chain) = chain else { break };
            if let Some(log) = worker.log.as_mut() {
                log.take_off(chain.head_index());
            }
            self.complete(vring, worker, &mem, chain)?;
            served = true;
        }
        if served && vring.needs_notification().map_err(to_io)? {
            vring.signal_used_queue()?;
        }
        Ok(())
    }

    /// Serves `chain` (served against `mem`, the guest's table) and puts it on the used
    /// ring, linking it in the inflight log before and clearing it after (see
    /// [`crate::inflight`]).
    fn complete<M>(
        &self,
        vring: &VringRwLock,
        worker: &mut Worker,
        mem: &GuestMemoryMmap,
        chain: DescriptorChain<M>,
    ) -> io::Result<()>
    where
        M: std::ops::Deref<Target = GuestMemoryMmap> + Clone,
    {
        let head = chain.head_index();
        let used = worker.serve(&*self.inner.target, mem, chain);
        if let Some(log) = &worker.log {
            log.link_used(head);
        }
        vring.add_used(head, used).map_err(to_io)?;
        if let Some(log) = &worker.log {
            log.used(head, vring.get_ref().get_queue().next_used());
        }
        Ok(())
    }

    /// Gives every queue its part of the inflight region the front end set
    /// (SET_INFLIGHT_FD); each recovers from it before it next pops a chain.
    pub(crate) fn install_inflight(&self, region: &Arc<Region>) -> io::Result<()> {
        for (queue, worker) in self.inner.workers.iter().enumerate() {
            let mut worker = worker
                .lock()
                .map_err(|_| io::Error::other("a worker panicked"))?;
            let queue = u16::try_from(queue).expect("at most QUEUES_MAX queues");
            worker.log = QueueLog::new(Arc::clone(region), queue);
        }
        Ok(())
    }

    /// Queues the device offers.
    pub(crate) fn queues(&self) -> u16 {
        self.inner.queues
    }

    /// Once after an inflight region was set, before anything is popped: resubmits the
    /// chains it lists (in the order they were taken off the ring) and makes the next chain
    /// to pop the one after the used ring's and those, whatever base the front end sent.
    fn resubmit(&self, vring: &VringRwLock, worker: &mut Worker) -> io::Result<()> {
        let Some(log) = worker.log.as_mut().filter(|log| log.pending) else {
            return Ok(());
        };
        log.pending = false;
        let mem = self.inner.mem.memory();
        let (size, desc_table, used_idx) = {
            let state = vring.get_ref();
            let queue = state.get_queue();
            let used_idx = queue.used_idx(&*mem, Ordering::Acquire).map_err(to_io)?;
            (queue.size(), queue.desc_table(), used_idx.0)
        };
        if size != log.size() {
            tracing::warn!(
                ring = size,
                region = log.size(),
                "vhost-user-blk: inflight region for another queue size: not tracked"
            );
            worker.log = None;
            return Ok(());
        }
        let heads = log.recover(used_idx);
        let in_flight = u16::try_from(heads.len()).expect("at most a queue's size");
        {
            let mut state = vring.get_mut();
            let queue = state.get_queue_mut();
            queue.set_next_used(used_idx);
            queue.set_next_avail(used_idx.wrapping_add(in_flight));
        }
        if heads.is_empty() {
            return Ok(());
        }
        tracing::info!(
            requests = heads.len(),
            "vhost-user-blk: resubmitting the requests in flight when the last backend ended"
        );
        let mut replay = Replay::new(&mem, GuestAddress(desc_table), size, &heads)?;
        while let Some(chain) = replay.next_chain() {
            self.complete(vring, worker, &mem, chain)?;
        }
        if vring.needs_notification().map_err(to_io)? {
            vring.signal_used_queue()?;
        }
        Ok(())
    }
}

fn to_io(error: virtio_queue::Error) -> io::Error {
    io::Error::other(error.to_string())
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        usize::from(self.inner.queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(QUEUE_SIZE_MAX)
    }

    fn features(&self) -> u64 {
        config::features(&self.inner.target.geometry(), self.inner.queues)
    }

    fn acked_features(&self, features: u64) {
        self.inner.acked.store(features, Ordering::Release);
        let write_back = config::has(features, VIRTIO_BLK_F_FLUSH);
        for worker in &self.inner.workers {
            if let Ok(mut worker) = worker.lock() {
                worker.write_back = write_back;
            }
        }
    }

    /// `BACKEND_REQ` and `CONFIG` carry the capacity-change message (`crate::capacity`).
    /// `BACKEND_REQ` is also what Linux 6.1's UML `virtio_uml` needs to attach at all: it
    /// takes the IRQ number for its queues' call fds from the one it allocates for the
    /// backend-request channel, so without that channel it asks for IRQ 0 (the timer's)
    /// and virtio_blk's probe fails with EBUSY.
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::BACKEND_REQ
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_backend_req_fd(&self, backend: Backend) {
        if let Ok(mut held) = self.inner.backend_req.lock() {
            *held = Some(backend);
        }
    }

    /// The handler sets event idx on the queues themselves; virtio-queue then suppresses
    /// notifications (avail_event) and calls (used_event) by the indexes.
    fn set_event_idx(&self, _enabled: bool) {}

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = config::config_space(&self.inner.target.geometry(), self.inner.queues);
        config::config_slice(&space, offset, size)
    }

    fn update_memory(&self, _mem: Memory) -> io::Result<()> {
        // The handler replaced the table in the GuestMemoryAtomic we share with it; every
        // queue thread looks at its ring again (see the module docs).
        for (_, notifier) in &self.inner.rescans {
            notifier.notify()?;
        }
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.inner.queues).map(|queue| 1u64 << queue).collect()
    }

    fn exit_event(&self, thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (consumer, notifier) = self.inner.exits.get(thread_index)?;
        let consumer = consumer.lock().ok()?.take()?;
        Some((consumer, notifier.try_clone().ok()?))
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event set {evset:?}")));
        }
        if device_event == self.rescan_event() {
            return self.rescan(vrings, thread_id);
        }
        let vring = vrings
            .get(usize::from(device_event))
            .ok_or_else(|| io::Error::other(format!("no queue {device_event}")))?;
        let worker = self
            .inner
            .workers
            .get(thread_id)
            .ok_or_else(|| io::Error::other(format!("no worker {thread_id}")))?;
        let mut worker = worker
            .lock()
            .map_err(|_| io::Error::other("a worker panicked"))?;
        self.serve_queue(vring, &mut worker)
    }
}
