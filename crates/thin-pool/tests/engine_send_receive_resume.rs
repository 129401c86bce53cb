//! Goal: a resumable receive cut at any byte of its stream (and the pool reopened as after
//! a crash, or not) keeps a partial receive that is no volume, checks clean, and that
//! `send_resumed` with its token completes to exactly the sent snapshot (bytes and mapped
//! blocks), full and incremental, across block sizes, however many times it is cut; a
//! token of another stream, a stale token and a whole stream over a kept partial one are
//! refused with nothing changed; an aborted partial receive frees every block it held.
//! Method: a model of the sender's volume (random writes and discards), streams in memory
//! cut at random byte positions, the metadata checked after every interruption.

mod engine_send_receive_kit;

use engine_send_receive_kit::{mapped, observe, pool, read_all, send, Model, SIZE};
use rand::Rng;
use thin_pool::format::check::{check, CheckOptions};
use thin_pool::stream::{self, Interrupted, ReceiveOptions, ResumeToken};
use thin_pool::testing::{deterministic_options, MemoryParts};
use thin_pool::{Pool, VolumeInfo};

const SENDER_BLOCK: u64 = 64 << 10;

/// Checkpoints often, so cuts land between them.
const OPTIONS: ReceiveOptions = ReceiveOptions {
    checkpoint_bytes: 96 << 10,
};

fn receive_resumable(pool: &Pool, name: &str, bytes: &[u8]) -> Result<VolumeInfo, Interrupted> {
    stream::receive_resumable(pool, name, bytes, &OPTIONS, &mut |_| {}).map(|(info, _)| info)
}

fn send_resumed(pool: &Pool, snapshot: &str, base: Option<&str>, token: &ResumeToken) -> Vec<u8> {
    let mut out = Vec::new();
    stream::send_resumed(pool, snapshot, base, token, &mut out, &mut |_| {}).unwrap();
    out
}

fn assert_checks_clean(parts: &MemoryParts, what: &str) {
    let report = check(
        parts.metadata.clone(),
        &CheckOptions::default(),
        &mut |_| {},
    );
    assert!(report.is_clean(), "{what}:\n{report}");
}

/// Receive `snapshot` of `sender` (with `base`) as `name`, cutting every stream at a random
/// byte until `cuts` cuts were made, reopening the receiver's pool after some; answers the
/// receiver's pool and how many resumed streams it took.
#[allow(clippy::too_many_arguments)]
fn receive_with_cuts(
    sender: &Pool,
    snapshot: &str,
    base: Option<&str>,
    parts: &MemoryParts,
    mut receiver: Pool,
    name: &str,
    cuts: usize,
    rng: &mut impl Rng,
) -> (Pool, usize) {
    let mut resumed = 0;
    let mut bytes = send(sender, snapshot, base);
    let mut token: Option<ResumeToken> = None;
    for cut in 0..=cuts {
        let last = cut == cuts;
        let at = if last {
            bytes.len()
        } else {
            rng.gen_range(0..bytes.len())
        };
        match receive_resumable(&receiver, name, &bytes[..at]) {
            Ok(_) => {
                assert!(last || at == bytes.len(), "a cut stream is never a volume");
                break;
            }
            Err(interrupted) => {
                assert!(!last, "the whole stream is received: {interrupted}");
                assert!(
                    receiver.info(name).is_err(),
                    "a partial receive is no volume"
                );
                assert!(receiver.disagreements().is_empty(), "no unadopted thin id");
                let kept = receiver.partial_receives();
                match &interrupted.token {
                    Some(t) => {
                        assert_eq!(kept.len(), 1);
                        assert_eq!(*t, ResumeToken::of(&kept[0]).unwrap());
                        // Never goes back.
                        assert!(token.is_none_or(|old| old.offset <= t.offset));
                        token = Some(*t);
                    }
                    None => assert!(kept.is_empty() && token.is_none(), "{kept:?}"),
                }
            }
        }
        if rng.gen_bool(0.5) {
            // As after a crash: the handle dropped without a close, the parts reopened.
            drop(receiver);
            receiver = parts.reopen(deterministic_options());
        }
        assert_checks_clean(parts, &format!("after cut {cut} at byte {at}"));
        bytes = match &token {
            Some(token) => {
                resumed += 1;
                send_resumed(sender, snapshot, base, token)
            }
            None => send(sender, snapshot, base),
        };
    }
    assert!(receiver.partial_receives().is_empty());
    assert_checks_clean(parts, "after the receive");
    (receiver, resumed)
}

#[test]
fn cut_receives_resume_to_the_snapshot_byte_for_byte() {
    let (_report, mut rng) = testkit::seed::seeded_rng();
    let mut resumed = 0;
    for case in 0..testkit::seed::case_count(6) {
        let receiver_block = [64 << 10, 128 << 10, 1 << 20][case as usize % 3];
        let (_sender_parts, sender) = pool(SENDER_BLOCK, 32);
        sender.create_volume("vm", SIZE).unwrap();
        let mut model = Model::new(SIZE, SENDER_BLOCK);
        model.mutate(&sender, "vm", &mut rng, 60);
        sender.snapshot("vm", "s1", true).unwrap();
        let s1 = model.clone();
        model.mutate(&sender, "vm", &mut rng, 20);
        sender.snapshot("vm", "s2", true).unwrap();

        let (parts, receiver) = pool(receiver_block, 32);
        let cuts = rng.gen_range(1..=4);
        let (receiver, n) =
            receive_with_cuts(&sender, "s1", None, &parts, receiver, "r1", cuts, &mut rng);
        resumed += n;
        assert_eq!(read_all(&receiver, "r1"), s1.bytes, "case {case}: full");
        assert_eq!(mapped(&receiver, "r1"), s1.expected_mapped(receiver_block));
        let (receiver, n) = receive_with_cuts(
            &sender,
            "s2",
            Some("s1"),
            &parts,
            receiver,
            "r2",
            cuts,
            &mut rng,
        );
        resumed += n;
        assert_eq!(
            read_all(&receiver, "r2"),
            model.bytes,
            "case {case}: increment"
        );
        assert_eq!(read_all(&receiver, "r1"), s1.bytes, "the base is untouched");
        assert_eq!(
            mapped(&receiver, "r2"),
            model.expected_mapped(receiver_block)
        );
        receiver.close().unwrap();
    }
    assert!(resumed > 0, "some cuts kept something to resume");
}

/// A receive of `s1` cut at half its stream, with its token.
fn half_received(sender: &Pool, receiver: &Pool, name: &str) -> ResumeToken {
    let bytes = send(sender, "s1", None);
    let interrupted = receive_resumable(receiver, name, &bytes[..bytes.len() / 2]).unwrap_err();
    let token = interrupted.token.expect("half the stream is kept");
    assert!(token.offset > 0);
    token
}

fn sender_with_two_snapshots(rng: &mut impl Rng) -> (MemoryParts, Pool) {
    let (parts, sender) = pool(SENDER_BLOCK, 32);
    sender.create_volume("vm", SIZE).unwrap();
    let mut model = Model::new(SIZE, SENDER_BLOCK);
    model.mutate(&sender, "vm", rng, 60);
    sender.snapshot("vm", "s1", true).unwrap();
    model.mutate(&sender, "vm", rng, 60);
    sender.snapshot("vm", "other", true).unwrap();
    (parts, sender)
}

#[test]
fn wrong_and_stale_tokens_are_refused_with_nothing_changed() {
    let (_report, mut rng) = testkit::seed::seeded_rng();
    let (_sp, sender) = sender_with_two_snapshots(&mut rng);
    let (_rp, receiver) = pool(SENDER_BLOCK, 32);
    let token = half_received(&sender, &receiver, "r");
    let before = observe(&receiver);
    let kept = receiver.partial_receives();

    // A token of another stream: the sender refuses it.
    let mut out = Vec::new();
    let refused = stream::send_resumed(&sender, "other", None, &token, &mut out, &mut |_| {});
    assert!(refused.is_err() && out.is_empty(), "{refused:?}");
    // A token of a full stream with a base: refused.
    assert!(
        stream::send_resumed(&sender, "s1", Some("other"), &token, &mut out, &mut |_| {}).is_err()
    );

    // A resumed stream of another stream at the same offset: the receiver refuses it.
    stream::send(&sender, "other", None, &mut Vec::new(), &mut |_| {}).unwrap();
    let other = ResumeToken {
        stream_id: uuid::Uuid::parse_str(&sender.content_id("other").unwrap().unwrap()).unwrap(),
        ..token
    };
    let bytes = send_resumed(&sender, "other", None, &other);
    let refused = receive_resumable(&receiver, "r", &bytes).unwrap_err();
    assert!(
        refused.error.to_string().contains("another stream"),
        "{refused}"
    );
    assert_eq!(
        refused.token,
        Some(token),
        "the kept receive keeps its token"
    );

    // A stale token (an older offset of the same stream).
    let stale = ResumeToken {
        offset: token.offset - SENDER_BLOCK,
        ..token
    };
    let bytes = send_resumed(&sender, "s1", None, &stale);
    let refused = receive_resumable(&receiver, "r", &bytes).unwrap_err();
    assert!(refused.error.to_string().contains("stale"), "{refused}");

    // The whole stream again under the kept name, resumable or not.
    let whole = send(&sender, "s1", None);
    assert!(receive_resumable(&receiver, "r", &whole).is_err());
    assert!(stream::receive(&receiver, "r", &whole[..], &mut |_| {}).is_err());
    // A resumed stream without --resumable.
    let rest = send_resumed(&sender, "s1", None, &token);
    assert!(stream::receive(&receiver, "r", &rest[..], &mut |_| {}).is_err());
    // A resumed stream for a name that keeps nothing.
    assert!(receive_resumable(&receiver, "nothing-here", &rest).is_err());

    assert_eq!(observe(&receiver), before);
    assert_eq!(receiver.partial_receives(), kept);
    // And the right token still completes it.
    receive_resumable(&receiver, "r", &rest).unwrap();
    assert_eq!(read_all(&receiver, "r"), read_all(&sender, "s1"));
}

#[test]
fn an_aborted_partial_receive_frees_every_block_it_held() {
    let (_report, mut rng) = testkit::seed::seeded_rng();
    let (_sp, sender) = sender_with_two_snapshots(&mut rng);
    let (parts, receiver) = pool(SENDER_BLOCK, 32);
    let before = observe(&receiver);
    half_received(&sender, &receiver, "r");
    let kept = receiver.partial_receives();
    assert_eq!(kept.len(), 1);
    assert!(kept[0].blocks > 0);
    // The blocks it holds are counted as used.
    assert_eq!(
        receiver.status().data_used_blocks,
        before.data_used_blocks + kept[0].blocks
    );
    // Across a reopen too.
    drop(receiver);
    let receiver = parts.reopen(deterministic_options());
    assert_eq!(receiver.partial_receives(), kept);
    assert_eq!(receiver.abort_receive("r").unwrap(), kept[0]);
    assert!(receiver.abort_receive("r").is_err(), "dropped once");
    assert!(receiver.partial_receives().is_empty());
    let after = observe(&receiver);
    assert_eq!(after.data_used_blocks, before.data_used_blocks);
    assert_eq!(after.volumes, before.volumes);
    assert_checks_clean(&parts, "after the abort");
    // The name is free for a whole stream again.
    let whole = send(&sender, "s1", None);
    stream::receive(&receiver, "r", &whole[..], &mut |_| {}).unwrap();
    assert_eq!(read_all(&receiver, "r"), read_all(&sender, "s1"));
}
