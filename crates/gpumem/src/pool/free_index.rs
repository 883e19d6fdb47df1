//! The free blocks of one stream and pool, indexed for exact best fit.
//!
//! Blocks are binned by size (four bins per power of two); a bitmap says which bins are
//! non-empty, and each bin is ordered by (size, address). Best fit searches the request's own
//! bin in O(log n) and otherwise takes the first block of the next non-empty bin, found in O(1)
//! from the bitmap. A bin is a sorted vector while it is small (a binary search and a short
//! move, no allocation in steady state) and a `BTreeSet` once it grows past [`BIG`] entries.

use std::collections::BTreeSet;

/// A bin turns into a B-tree at this many entries...
const BIG: usize = 64;
/// ...and back into a vector below this many.
const SMALL: usize = 16;

/// One bin: the keys of its blocks in order.
#[derive(Debug)]
enum Bin {
    Vec(Vec<Key>),
    Tree(BTreeSet<Key>),
}

impl Bin {
    fn insert(&mut self, k: Key) {
        match self {
            Bin::Vec(v) => {
                let i = v.partition_point(|&x| x < k);
                v.insert(i, k);
                if v.len() >= BIG {
                    *self = Bin::Tree(v.drain(..).collect());
                }
            }
            Bin::Tree(t) => {
                t.insert(k);
            }
        }
    }

    fn remove(&mut self, k: Key) -> bool {
        match self {
            Bin::Vec(v) => match v.binary_search(&k) {
                Ok(i) => {
                    v.remove(i);
                    true
                }
                Err(_) => false,
            },
            Bin::Tree(t) => {
                let removed = t.remove(&k);
                if t.len() < SMALL {
                    *self = Bin::Vec(std::mem::take(t).into_iter().collect());
                }
                removed
            }
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Bin::Vec(v) => v.is_empty(),
            Bin::Tree(t) => t.is_empty(),
        }
    }

    /// Keys at or above `lo`, in order (no allocation: the search paths walk many bins).
    fn from(&self, lo: Key) -> BinIter<'_> {
        match self {
            Bin::Vec(v) => {
                let i = v.partition_point(|&x| x < lo);
                BinIter::Vec(v[i..].iter())
            }
            Bin::Tree(t) => BinIter::Tree(t.range(lo..)),
        }
    }

    #[inline]
    fn first_from(&self, lo: Key) -> Option<Key> {
        match self {
            Bin::Vec(v) => v.get(v.partition_point(|&x| x < lo)).copied(),
            Bin::Tree(t) => t.range(lo..).next().copied(),
        }
    }

    fn last(&self) -> Option<Key> {
        match self {
            Bin::Vec(v) => v.last().copied(),
            Bin::Tree(t) => t.last().copied(),
        }
    }
}

/// The keys of one bin from some key on (see [`Bin::from`]).
enum BinIter<'a> {
    Vec(std::slice::Iter<'a, Key>),
    Tree(std::collections::btree_set::Range<'a, Key>),
}

impl Iterator for BinIter<'_> {
    type Item = Key;

    #[inline]
    fn next(&mut self) -> Option<Key> {
        match self {
            BinIter::Vec(i) => i.next().copied(),
            BinIter::Tree(i) => i.next().copied(),
        }
    }
}

const SUB_BITS: u32 = 2;
const BINS: usize = 64 << SUB_BITS;
const WORDS: usize = BINS / 64;

/// (size / 512) << 87 | (address / 512) << 32 | block id: sorts by size, then address.
type Key = u128;

fn key(size: u64, addr: u64, id: u32) -> Key {
    ((size >> 9) as u128) << 87 | ((addr >> 9) as u128) << 32 | id as u128
}

/// Decode a key into (size, address, block id).
fn decode(k: Key) -> (u64, u64, u32) {
    (
        ((k >> 87) as u64) << 9,
        (((k >> 32) as u64) & ((1 << 55) - 1)) << 9,
        k as u32,
    )
}

fn bin(size: u64) -> usize {
    let fl = 63 - size.leading_zeros();
    let sl = (size >> fl.saturating_sub(SUB_BITS)) & ((1 << SUB_BITS) - 1);
    ((fl << SUB_BITS) as u64 + sl) as usize
}

/// Free blocks of one (stream, pool).
#[derive(Debug)]
pub(crate) struct FreeIndex {
    bins: Vec<Bin>,
    bitmap: [u64; WORDS],
    len: usize,
}

impl Default for FreeIndex {
    fn default() -> Self {
        Self {
            bins: (0..BINS).map(|_| Bin::Vec(Vec::new())).collect(),
            bitmap: [0; WORDS],
            len: 0,
        }
    }
}

impl FreeIndex {
    pub(crate) fn insert(&mut self, size: u64, addr: u64, id: u32) {
        let b = bin(size);
        self.bins[b].insert(key(size, addr, id));
        self.bitmap[b / 64] |= 1 << (b % 64);
        self.len += 1;
    }

    pub(crate) fn remove(&mut self, size: u64, addr: u64, id: u32) -> bool {
        let b = bin(size);
        let set = &mut self.bins[b];
        if !set.remove(key(size, addr, id)) {
            return false;
        }
        if set.is_empty() {
            self.bitmap[b / 64] &= !(1 << (b % 64));
        }
        self.len -= 1;
        true
    }

    /// First non-empty bin at or after `b`.
    fn next_bin(&self, b: usize) -> Option<usize> {
        let (mut w, bit) = (b / 64, b % 64);
        let mut word = self.bitmap.get(w)? & (!0u64 << bit);
        loop {
            if word != 0 {
                return Some(w * 64 + word.trailing_zeros() as usize);
            }
            w += 1;
            word = *self.bitmap.get(w)?;
        }
    }

    /// The smallest block of at least `size` bytes (lowest address among equals).
    #[inline]
    pub(crate) fn best_fit(&self, size: u64) -> Option<(u64, u64, u32)> {
        if self.len == 0 {
            return None;
        }
        let size = size.next_multiple_of(512);
        let b = bin(size);
        if let Some(k) = self.bins[b].first_from(key(size, 0, 0)) {
            return Some(decode(k));
        }
        let nb = self.next_bin(b + 1)?;
        self.bins[nb].first_from(0).map(decode)
    }

    /// Blocks of at least `size` bytes in increasing size order.
    pub(crate) fn at_least(&self, size: u64) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        let size = size.next_multiple_of(512);
        let b = bin(size);
        let lo = key(size, 0, 0);
        self.bins[b]
            .from(lo)
            .chain(
                self.bins[b + 1..]
                    .iter()
                    .filter(|s| !s.is_empty())
                    .flat_map(|s| s.from(0)),
            )
            .map(decode)
    }

    /// Every block, unordered across bins.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.bins
            .iter()
            .filter(|s| !s.is_empty())
            .flat_map(|s| s.from(0))
            .map(decode)
    }

    /// Largest block size, if any.
    pub(crate) fn largest(&self) -> Option<u64> {
        self.largest_block().map(|b| b.0)
    }

    /// The largest block `(size, addr, id)`, if any.
    pub(crate) fn largest_block(&self) -> Option<(u64, u64, u32)> {
        let b = (0..BINS)
            .rev()
            .find(|&b| self.bitmap[b / 64] & (1 << (b % 64)) != 0)?;
        self.bins[b].last().map(decode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        for (s, a, i) in [(512, 0, 0), (1 << 49, (1 << 63) + 512 * 7, u32::MAX - 1)] {
            assert_eq!(decode(key(s, a, i)), (s, a, i));
        }
    }

    #[test]
    fn best_fit_is_exact() {
        let mut f = FreeIndex::default();
        let sizes = [4096u64, 1536, 10 << 20, 3 << 20, 2048, 5000 * 512];
        for (i, &s) in sizes.iter().enumerate() {
            f.insert(s, (i as u64 + 1) << 30, i as u32);
        }
        for want in [
            512u64,
            1536,
            1537,
            2049,
            4097,
            3 << 20,
            (3 << 20) + 1,
            10 << 20,
        ] {
            let expect = sizes.iter().copied().filter(|&s| s >= want).min();
            assert_eq!(f.best_fit(want).map(|x| x.0), expect, "request {want}");
        }
        assert_eq!(f.best_fit((10 << 20) + 1), None);
        assert_eq!(f.largest(), Some(10 << 20));
        assert!(f.remove(10 << 20, 3 << 30, 2));
        assert!(!f.remove(10 << 20, 3 << 30, 2));
        assert_eq!(f.largest(), Some(3 << 20));
        let all: Vec<u64> = f.at_least(2000).map(|x| x.0).collect();
        assert_eq!(all, vec![2048, 4096, 5000 * 512, 3 << 20]);
    }

    #[test]
    fn big_bins_switch_to_trees_and_back() {
        let mut f = FreeIndex::default();
        for i in 0..200u32 {
            f.insert(8192, (i as u64 + 1) << 20, i);
        }
        assert!(matches!(f.bins[bin(8192)], Bin::Tree(_)));
        assert_eq!(
            f.best_fit(8000),
            Some((8192, 1 << 20, 0)),
            "lowest address first"
        );
        for i in 0..195u32 {
            assert!(f.remove(8192, (i as u64 + 1) << 20, i));
        }
        assert!(matches!(f.bins[bin(8192)], Bin::Vec(_)));
        assert_eq!(f.best_fit(8192), Some((8192, 196 << 20, 195)));
        assert_eq!(f.iter().count(), 5);
    }
}
