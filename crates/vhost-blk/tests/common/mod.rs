//! A vhost-user-blk client for tests: libblkio's `virtio-blk-vhost-user` driver (a complete
//! userspace virtio-blk front end), with its request memory (a memfd it shares with the
//! backend) read and written through the memfd's file, and a byte model to compare with.
//!
//! The one `unsafe` of this crate's tests: reading the completions `do_io` fills, which the
//! blkio API hands back as `MaybeUninit` (every entry is initialized here before the call).

#![allow(dead_code)]

use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::FileExt;
use std::path::Path;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

/// Bytes of request memory per request slot.
pub const SLOT: usize = 256 << 10;
/// Request slots (the most requests in flight at once, over all queues).
pub const SLOTS: usize = 32;

/// One request, as a test describes it.
#[derive(Clone, Debug)]
pub enum Op {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
        data: Vec<u8>,
        fua: bool,
    },
    Zero {
        offset: u64,
        len: u64,
        unmap: bool,
    },
    Discard {
        offset: u64,
        len: u64,
    },
    Flush,
}

/// A connected client.
pub struct Client {
    blkio: Blkio,
    pub queues: Vec<Blkioq>,
    region: MemoryRegion,
    /// The request memory, as a file.
    memory: File,
}

impl Client {
    /// Connects to `socket` with `queues` queues.
    pub fn connect(socket: &Path, queues: i32) -> blkio::Result<Client> {
        Self::connect_with(socket, queues, false)
    }

    /// Connects, read-only if `read_only` (libblkio refuses a read-write connection to a
    /// device that offers VIRTIO_BLK_F_RO).
    pub fn connect_with(socket: &Path, queues: i32, read_only: bool) -> blkio::Result<Client> {
        let mut blkio = Blkio::new("virtio-blk-vhost-user")?;
        blkio.set_str("path", socket.to_str().unwrap())?;
        blkio.set_bool("read-only", read_only)?;
        blkio.connect()?;
        blkio.set_i32("num-queues", queues)?;
        let started = blkio.start()?;
        let align = blkio.get_u64("mem-region-alignment")? as usize;
        let len = (SLOT * SLOTS).next_multiple_of(align);
        let region = blkio.alloc_mem_region(len)?;
        blkio.map_mem_region(&region)?;
        let memory = File::options()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", region.fd))
            .expect("the request memory's memfd");
        Ok(Client {
            blkio,
            queues: started.queues,
            region,
            memory,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.blkio.get_u64("capacity").unwrap()
    }

    pub fn get_u64(&self, name: &str) -> u64 {
        self.blkio.get_u64(name).unwrap()
    }

    pub fn get_i32(&self, name: &str) -> i32 {
        self.blkio.get_i32(name).unwrap()
    }

    fn slot_addr(&self, slot: usize) -> usize {
        assert!(slot < SLOTS);
        self.region.addr + slot * SLOT
    }

    /// Submits `op` on `queue` with request memory `slot`; `user_data` is the slot.
    pub fn submit(&mut self, queue: usize, slot: usize, op: &Op) {
        let addr = self.slot_addr(slot);
        let q = &mut self.queues[queue];
        match op {
            Op::Read { offset, len } => {
                assert!(*len <= SLOT);
                q.read(*offset, addr as *mut u8, *len, slot, ReqFlags::empty());
            }
            Op::Write { offset, data, fua } => {
                assert!(data.len() <= SLOT);
                self.memory
                    .write_all_at(data, (slot * SLOT) as u64)
                    .unwrap();
                let flags = if *fua {
                    ReqFlags::FUA
                } else {
                    ReqFlags::empty()
                };
                let q = &mut self.queues[queue];
                q.write(*offset, addr as *const u8, data.len(), slot, flags);
            }
            Op::Zero { offset, len, unmap } => {
                let flags = if *unmap {
                    ReqFlags::empty()
                } else {
                    ReqFlags::NO_UNMAP
                };
                q.write_zeroes(*offset, *len, slot, flags);
            }
            Op::Discard { offset, len } => q.discard(*offset, *len, slot, ReqFlags::empty()),
            Op::Flush => q.flush(slot, ReqFlags::empty()),
        }
    }

    /// Waits for `count` completions on `queue`: (slot, ret) each.
    pub fn wait(&mut self, queue: usize, count: usize) -> Vec<(usize, i32)> {
        let mut done = Vec::new();
        while done.len() < count {
            let mut completions: Vec<MaybeUninit<Completion>> = (0..count - done.len())
                .map(|_| {
                    MaybeUninit::new(Completion {
                        user_data: usize::MAX,
                        error_msg: std::ptr::null(),
                        ret: i32::MIN,
                        reserved_: [0; 12],
                    })
                })
                .collect();
            let n = self.queues[queue]
                .do_io(&mut completions, 1, None, None)
                .unwrap();
            for completion in &completions[..n] {
                // SAFETY: every entry was initialized with `MaybeUninit::new` above, and
                // `do_io` only overwrites entries with whole `Completion` values.
                let completion = unsafe { completion.assume_init_ref() };
                done.push((completion.user_data, completion.ret));
            }
        }
        done
    }

    /// The bytes a completed read left in `slot`.
    pub fn slot_bytes(&self, slot: usize, len: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; len];
        self.memory
            .read_exact_at(&mut bytes, (slot * SLOT) as u64)
            .unwrap();
        bytes
    }

    /// Runs one request to completion on `queue`: its ret, and a read's bytes.
    pub fn run(&mut self, queue: usize, op: &Op) -> (i32, Vec<u8>) {
        self.submit(queue, 0, op);
        let done = self.wait(queue, 1);
        assert_eq!(done[0].0, 0);
        let bytes = match op {
            Op::Read { len, .. } if done[0].1 == 0 => self.slot_bytes(0, *len),
            _ => Vec::new(),
        };
        (done[0].1, bytes)
    }
}

/// The bytes a device should hold.
pub struct Model(pub Vec<u8>);

impl Model {
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Write { offset, data, .. } => {
                self.0[*offset as usize..*offset as usize + data.len()].copy_from_slice(data)
            }
            Op::Zero { offset, len, .. } | Op::Discard { offset, len } => {
                self.0[*offset as usize..(*offset + *len) as usize].fill(0)
            }
            Op::Read { .. } | Op::Flush => {}
        }
    }

    pub fn bytes(&self, offset: u64, len: usize) -> &[u8] {
        &self.0[offset as usize..offset as usize + len]
    }
}

/// A small deterministic generator (xorshift64*), so a failure replays.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
