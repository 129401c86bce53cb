//! The region's bookkeeping without a socket: created, opened, logged, crashed at each point
//! of the used-ring update, recovered.

use std::os::unix::fs::FileExt;

use super::*;

fn description(num_queues: u16, queue_size: u16) -> Description {
    Description {
        mmap_size: 0,
        mmap_offset: 0,
        num_queues,
        queue_size,
    }
}

fn region(num_queues: u16, queue_size: u16) -> (Description, File, Arc<Region>) {
    let (answer, file) = create(&description(num_queues, queue_size), 4).expect("create");
    let region = open(&answer, file.try_clone().expect("dup"), 4).expect("open");
    (answer, file, region)
}

#[test]
fn description_round_trips_and_a_wrong_size_is_refused() {
    let d = Description {
        mmap_size: 4128,
        mmap_offset: 4096,
        num_queues: 2,
        queue_size: 128,
    };
    assert_eq!(Description::parse(&d.encode()).expect("parse"), d);
    assert!(Description::parse(&d.encode()[..20]).is_err());
    assert!(Description::parse(&[0; 32]).is_err());
}

#[test]
fn create_refuses_dimensions_the_device_does_not_have() {
    assert!(create(&description(5, 16), 4).is_err(), "too many queues");
    assert!(create(&description(0, 16), 4).is_err(), "no queue");
    assert!(create(&description(1, 0), 4).is_err(), "empty queues");
    assert!(
        create(&description(1, QUEUE_SIZE_MAX + 1), 4).is_err(),
        "queues longer than the ring's maximum"
    );
    let (answer, _) = create(&description(2, 16), 4).expect("fits");
    assert_eq!(answer.mmap_size, 2 * (16 + 16 * 16));
}

#[test]
fn open_refuses_short_unsealed_or_foreign_regions() {
    let (answer, file) = create(&description(1, 16), 4).expect("create");
    let short = Description {
        mmap_size: answer.mmap_size - 1,
        ..answer
    };
    assert!(
        open(&short, file.try_clone().unwrap(), 4).is_err(),
        "too small"
    );
    let past = Description {
        mmap_offset: 4096,
        ..answer
    };
    assert!(
        open(&past, file.try_clone().unwrap(), 4).is_err(),
        "past the end"
    );
    assert!(
        open(&answer, file.try_clone().unwrap(), 0).is_err(),
        "more queues"
    );
    let unsealed = File::from(memfd_create("unsealed", MemfdFlags::CLOEXEC).unwrap());
    unsealed.set_len(answer.mmap_size).unwrap();
    assert!(
        open(&answer, unsealed, 4).is_err(),
        "can shrink under the mapping"
    );
    // A header of another layout (version 1, desc_num 8 for a 16-entry queue).
    file.write_all_at(&1u16.to_le_bytes(), VERSION_AT as u64)
        .unwrap();
    file.write_all_at(&8u16.to_le_bytes(), DESC_NUM_AT as u64)
        .unwrap();
    assert!(open(&answer, file, 4).is_err(), "foreign header");
}

#[test]
fn completed_chains_leave_nothing_to_resubmit() {
    let (_, _, region) = region(1, 16);
    let mut log = QueueLog::new(region, 0).expect("queue 0");
    assert!(log.recover(0).is_empty());
    for (n, head) in [3u16, 0, 9].into_iter().enumerate() {
        log.take_off(head);
        log.link_used(head);
        log.used(head, n as u16 + 1);
    }
    assert!(log.recover(3).is_empty());
}

#[test]
fn chains_in_flight_come_back_in_the_order_they_were_taken() {
    let (answer, file, region) = region(2, 16);
    let mut log = QueueLog::new(Arc::clone(&region), 1).expect("queue 1");
    for head in [7u16, 2, 12, 5] {
        log.take_off(head);
    }
    // 2 completes (out of order); the others are in flight at the crash.
    log.link_used(2);
    log.used(2, 1);
    drop(log);
    drop(region);
    // The next process maps the same file.
    let region = open(&answer, file, 2).expect("reopen");
    let mut log = QueueLog::new(Arc::clone(&region), 1).expect("queue 1");
    assert_eq!(log.recover(1), vec![7, 12, 5]);
    let mut other = QueueLog::new(region, 0).expect("queue 0");
    assert!(other.recover(0).is_empty(), "queues are apart");
    // Chains taken after recovery come after those resubmitted.
    log.take_off(1);
    let mut again = QueueLog::new(Arc::clone(&log.region), 1).expect("queue 1");
    assert_eq!(again.recover(1), vec![7, 12, 5, 1]);
}

#[test]
fn a_crash_after_the_used_index_moved_clears_the_last_batch() {
    let (_, _, region) = region(1, 16);
    let mut log = QueueLog::new(Arc::clone(&region), 0).expect("queue 0");
    log.take_off(4);
    log.take_off(6);
    // 4 went on the used ring (index 1), and the process died before clearing its mark.
    log.link_used(4);
    let mut after = QueueLog::new(region, 0).expect("queue 0");
    assert_eq!(
        after.recover(1),
        vec![6],
        "4 reached the ring: not resubmitted"
    );
    // Died before the used index moved: 4 is still in flight.
    let (_, _, region) = self::region(1, 16);
    let mut log = QueueLog::new(Arc::clone(&region), 0).expect("queue 0");
    log.take_off(4);
    log.link_used(4);
    let mut after = QueueLog::new(region, 0).expect("queue 0");
    assert_eq!(after.recover(0), vec![4]);
}

#[test]
fn hostile_contents_stay_bounded() {
    let (answer, file, region) = region(1, 16);
    drop(region);
    // Every entry marked, a batch list that loops, a used index far ahead.
    let base = QUEUE_HEADER_BYTES as u64;
    for head in 0..16u64 {
        let mut entry = [0u8; DESC_STATE_BYTES];
        entry[INFLIGHT_AT] = 1;
        entry[NEXT_AT..NEXT_AT + 2].copy_from_slice(&(head as u16).to_le_bytes());
        entry[COUNTER_AT..].copy_from_slice(&u64::MAX.to_le_bytes());
        file.write_all_at(&entry, base + head * DESC_STATE_BYTES as u64)
            .unwrap();
    }
    file.write_all_at(&999u16.to_le_bytes(), LAST_BATCH_HEAD_AT as u64)
        .unwrap();
    let region = open(&answer, file, 1).expect("open");
    let mut log = QueueLog::new(region, 0).expect("queue 0");
    assert_eq!(log.recover(40_000).len(), 16);
    log.take_off(16); // past the queue: ignored
    log.take_off(3);
}
