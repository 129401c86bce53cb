//! Goal: for any write history, `receive(send(s2, base = s1))` applied on a received `s1`
//! gives exactly `s2` (bytes and mapped blocks), on a pool of the same or another block
//! size.
//! Method: proptest generates two histories of writes (offset, length, fill byte) and
//! whole-block discards; the first makes s1, the second (on the origin) s2; s1 goes full
//! and s2 as an increment to a receiver; the received s2 is compared with the sender's s2
//! read back (the sender itself is the model here) and its mapped blocks with the ones the
//! sender's mapped blocks overlap.

mod engine_send_receive_kit;

use engine_send_receive_kit::{mapped, pool, read_all, receive, send};
use proptest::prelude::*;
use thin_pool::Pool;

const SENDER_BLOCK: u64 = 64 << 10;
const SIZE: u64 = 2 << 20;

#[derive(Clone, Debug)]
enum Op {
    Write { offset: u64, len: u64, fill: u8 },
    Discard { block: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..SIZE / 512, 1..256u64, 1..=255u8).prop_map(|(sector, sectors, fill)| {
            let offset = sector * 512;
            Op::Write { offset, len: (sectors * 512).min(SIZE - offset), fill }
        }),
        1 => (0..SIZE / SENDER_BLOCK).prop_map(|block| Op::Discard { block }),
    ]
}

fn apply(pool: &Pool, ops: &[Op]) {
    let volume = pool.volume("vm").unwrap();
    for op in ops {
        match *op {
            Op::Write { offset, len, fill } => volume
                .write(offset, &vec![fill; len as usize], false)
                .unwrap(),
            Op::Discard { block } => volume.discard(block * SENDER_BLOCK, SENDER_BLOCK).unwrap(),
        }
    }
}

/// Which blocks of `block` bytes overlap a mapped block of the sender's.
fn overlapping(sender: &[bool], block: u64) -> Vec<bool> {
    (0..SIZE.div_ceil(block))
        .map(|b| {
            let (start, end) = (b * block, ((b + 1) * block).min(SIZE));
            (start / SENDER_BLOCK..end.div_ceil(SENDER_BLOCK)).any(|s| sender[s as usize])
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn increment_applied_on_base_gives_the_snapshot(
        first in proptest::collection::vec(op(), 0..40),
        second in proptest::collection::vec(op(), 0..40),
        receiver_block in prop_oneof![Just(64u64 << 10), Just(128 << 10), Just(256 << 10)],
    ) {
        let (_sp, sender) = pool(SENDER_BLOCK, 16);
        sender.create_volume("vm", SIZE).unwrap();
        apply(&sender, &first);
        sender.snapshot("vm", "s1", true).unwrap();
        apply(&sender, &second);
        sender.snapshot("vm", "s2", true).unwrap();
        let (_rp, receiver) = pool(receiver_block, 16);
        receive(&receiver, "s1", &send(&sender, "s1", None)).unwrap();
        receive(&receiver, "s2", &send(&sender, "s2", Some("s1"))).unwrap();
        prop_assert!(read_all(&receiver, "s2") == read_all(&sender, "s2"));
        prop_assert_eq!(
            mapped(&receiver, "s2"),
            overlapping(&mapped(&sender, "s2"), receiver_block)
        );
    }
}
