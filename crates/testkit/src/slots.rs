//! Crash-test content: a volume cut into slots, each rewritten whole by generations, so
//! that what a crash left can be checked against what was flushed.
//!
//! Every 4 KiB sector of a slot is `(slot, generation, sector index)` as three
//! little-endian `u64`s, then a fill byte made of all three. A sector read back after a
//! crash is either all zero (never written) or names its own slot and sector, a generation
//! at least the one the last completed flush covered, and carries the fill byte of those
//! three: a misplaced, stale or torn sector is told apart. A writer inside User-Mode Linux
//! can make the same bytes ([`fill_byte`] is simple arithmetic for that reason).

/// The size of a sector: the unit a torn write is detected in.
pub const SECTOR_BYTES: usize = 4096;

/// The byte filling sector `sector` of `slot` at `generation` after its 24-byte header.
pub fn fill_byte(slot: u64, generation: u64, sector: u64) -> u8 {
    (slot.wrapping_mul(7) + generation.wrapping_mul(13) + sector.wrapping_mul(31)) as u8
}

/// The `slot_bytes` (a multiple of [`SECTOR_BYTES`]) that generation `generation` of
/// `slot` writes.
pub fn slot_image(slot: u64, generation: u64, slot_bytes: usize) -> Vec<u8> {
    assert_eq!(slot_bytes % SECTOR_BYTES, 0, "slots are whole sectors");
    let mut image = Vec::with_capacity(slot_bytes);
    for sector in 0..(slot_bytes / SECTOR_BYTES) as u64 {
        image.extend_from_slice(&slot.to_le_bytes());
        image.extend_from_slice(&generation.to_le_bytes());
        image.extend_from_slice(&sector.to_le_bytes());
        image.resize(
            image.len() + SECTOR_BYTES - 24,
            fill_byte(slot, generation, sector),
        );
    }
    image
}

/// Checks one slot read back: every sector zero (only if nothing was flushed) or a valid
/// sector of a generation at least `flushed`. Panics naming `what`, the slot and the sector.
#[track_caller]
pub fn check_slot(what: &str, slot: u64, data: &[u8], flushed: u64) {
    for (sector, bytes) in data.chunks(SECTOR_BYTES).enumerate() {
        if bytes.iter().all(|&b| b == 0) {
            assert_eq!(
                flushed, 0,
                "{what} slot {slot} sector {sector}: zero, but generation {flushed} was flushed"
            );
            continue;
        }
        let word =
            |index: usize| u64::from_le_bytes(bytes[index * 8..index * 8 + 8].try_into().unwrap());
        let (found_slot, generation, found_sector) = (word(0), word(1), word(2));
        assert_eq!(
            (found_slot, found_sector),
            (slot, sector as u64),
            "{what} slot {slot} sector {sector}: misplaced (it is slot {found_slot} sector {found_sector})"
        );
        assert!(
            generation >= flushed,
            "{what} slot {slot} sector {sector}: generation {generation} older than flushed {flushed}"
        );
        let fill = fill_byte(slot, generation, sector as u64);
        assert!(
            bytes[24..].iter().all(|&b| b == fill),
            "{what} slot {slot} sector {sector}: torn or corrupt"
        );
    }
}

/// Checks a whole volume image of `flushed.len()` slots against the generation each slot's
/// last completed flush covered; returns how many slots had a flushed write.
#[track_caller]
pub fn check_volume(what: &str, image: &[u8], slot_bytes: usize, flushed: &[u64]) -> usize {
    assert_eq!(image.len(), flushed.len() * slot_bytes, "{what}: size");
    for (slot, data) in image.chunks(slot_bytes).enumerate() {
        check_slot(what, slot as u64, data, flushed[slot]);
    }
    flushed.iter().filter(|&&generation| generation > 0).count()
}

/// Panics, naming the first differing 4 KiB sector, unless `actual == expected`.
#[track_caller]
pub fn assert_same_bytes(what: &str, actual: &[u8], expected: &[u8]) {
    assert_eq!(actual.len(), expected.len(), "{what}: length differs");
    if let Some(sector) = actual
        .chunks(SECTOR_BYTES)
        .zip(expected.chunks(SECTOR_BYTES))
        .position(|(a, e)| a != e)
    {
        panic!(
            "{what}: differs first in the 4 KiB sector at byte {}",
            sector * SECTOR_BYTES
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_passes_and_each_kind_of_damage_is_caught() {
        let image = slot_image(3, 5, 2 * SECTOR_BYTES);
        check_slot("ok", 3, &image, 5);
        check_slot("newer than flushed", 3, &image, 4);
        check_slot("never written", 3, &vec![0; 2 * SECTOR_BYTES], 0);
        let fails = |data: Vec<u8>, flushed: u64| {
            std::panic::catch_unwind(|| check_slot("bad", 3, &data, flushed)).is_err()
        };
        assert!(fails(image.clone(), 6), "stale");
        assert!(fails(slot_image(4, 5, 2 * SECTOR_BYTES), 5), "misplaced");
        assert!(fails(vec![0; 2 * SECTOR_BYTES], 1), "lost");
        let mut torn = image.clone();
        torn[SECTOR_BYTES + 100] ^= 1;
        assert!(fails(torn, 5), "torn");
    }
}
