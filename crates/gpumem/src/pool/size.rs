//! Size rounding and segment sizing (the same rules as PyTorch's caching allocator).

use crate::config::Power2Divisions;

/// All block sizes are multiples of this.
pub const MIN_BLOCK: u64 = 512;
/// Requests up to this size are served from the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_SEGMENT: u64 = 2 << 20;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`]; also the slack allowed when an
/// unsplittable block serves a request.
pub const LARGE_SEGMENT: u64 = 20 << 20;
/// Large requests at least this big get a segment of their own size.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Granularity of large segments.
pub const ROUND_LARGE: u64 = 2 << 20;
/// Largest request accepted (1 PiB): anything bigger is a bug in the caller.
pub const MAX_REQUEST: u64 = 1 << 50;

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// Round `size` to the next of `divisions` equal steps between two powers of two.
fn next_division(size: u64, divisions: u32) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> divisions.trailing_zeros();
    if step == 0 {
        return floor << 1;
    }
    round_up(size, step)
}

/// The block size a request of `size` bytes gets.
pub fn round_size(size: u64, divisions: &Power2Divisions) -> u64 {
    if size < MIN_BLOCK {
        return MIN_BLOCK;
    }
    let d = divisions.for_size(size);
    if d > 1 && size > MIN_BLOCK * d as u64 {
        round_up(next_division(size, d), MIN_BLOCK)
    } else {
        round_up(size, MIN_BLOCK)
    }
}

/// The segment size obtained from the device for a block of `size` bytes.
pub fn segment_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_SEGMENT
    } else if size < MIN_LARGE_ALLOC {
        LARGE_SEGMENT
    } else {
        round_up(size, ROUND_LARGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_512() {
        let none = Power2Divisions::default();
        assert_eq!(round_size(1, &none), 512);
        assert_eq!(round_size(512, &none), 512);
        assert_eq!(round_size(513, &none), 1024);
        assert_eq!(round_size(1_000_000, &none), 1_000_448);
    }

    #[test]
    fn rounds_to_power2_divisions() {
        let four = Power2Divisions {
            intervals: vec![(0, 4)],
        };
        // between 1 MiB and 2 MiB the steps are 256 KiB
        assert_eq!(round_size((1 << 20) + 1, &four), (1 << 20) + (256 << 10));
        assert_eq!(round_size(1 << 20, &four), 1 << 20);
        // small sizes (<= 512 * divisions) keep 512 B granularity
        assert_eq!(round_size(1500, &four), 1536);
        let one = Power2Divisions {
            intervals: vec![(0, 1)],
        };
        assert_eq!(round_size(3 << 20, &one), 3 << 20); // 1 division = no power2 rounding
    }

    #[test]
    fn segment_sizes() {
        assert_eq!(segment_size(512), SMALL_SEGMENT);
        assert_eq!(segment_size(SMALL_SIZE), SMALL_SEGMENT);
        assert_eq!(segment_size(SMALL_SIZE + 512), LARGE_SEGMENT);
        assert_eq!(segment_size(MIN_LARGE_ALLOC), MIN_LARGE_ALLOC);
        assert_eq!(
            segment_size(MIN_LARGE_ALLOC + 1),
            MIN_LARGE_ALLOC + ROUND_LARGE
        );
    }
}
