//! The per-block loops of kvstrata's router, in Rust: a long prompt is thousands of KV blocks (4,096 at
//! 128K tokens, block size 32), and walking them through Python dicts cost milliseconds per request
//! (`make bench-router-overhead`). Policy stays in Python (router/index.py, router/scoring.py); these
//! types only hold per-endpoint maps and do bulk operations on them, each one pass in native code.
//!
//! Hashes come in as the router's ``array('Q')`` chains, read in place through the buffer protocol, or
//! as any sequence of ints (KV events), converted.

mod bytelevel;
mod digests;
mod followups;
mod front;
mod incremental;
mod predictions;
mod ranking;
mod rooms;

use std::collections::VecDeque;

// Every Rust allocation of the core (the tokenizer's strings and vectors, hyper's buffers): glibc's
// malloc cost more than the work it served. Python objects stay on Python's allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use rustc_hash::FxHashMap;

// Medium bits, as router/index.py uses them.
const GPU: u8 = 1;
const CPU: u8 = 2;
const STORAGE: u8 = 4;
const PREDICTED: u8 = 8;
const REAL: u8 = GPU | CPU | STORAGE;

/// Calls ``f`` with the ints of ``obj``: a contiguous buffer of ``T`` (the router's ``array('Q')``
/// hashes, an ``array('q')`` of token ids) is read in place; any other sequence of ints is converted
/// first (~40 ns per 64-bit Python int, what the buffer avoids).
pub(crate) fn with_ints<T, R>(obj: &Bound<'_, PyAny>, f: impl FnOnce(&[T]) -> R) -> PyResult<R>
where
    T: pyo3::buffer::Element + for<'a> FromPyObject<'a>,
{
    if let Ok(buf) = PyBuffer::<T>::get(obj) {
        if buf.is_c_contiguous() {
            // SAFETY: a C-contiguous buffer of item_count Ts, kept alive and unresizable while `buf`
            // is held; nothing in `f` runs Python code.
            let items =
                unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const T, buf.item_count()) };
            return Ok(f(items));
        }
    }
    let items: Vec<T> = obj.extract()?;
    Ok(f(&items))
}

/// [`with_ints`] for the router's 64-bit block hashes.
fn with_hashes<R>(obj: &Bound<'_, PyAny>, f: impl FnOnce(&[u64]) -> R) -> PyResult<R> {
    with_ints(obj, f)
}

#[derive(Clone, Copy)]
struct Entry {
    mask: u8,
    // Live predictions holding this entry (an unconfirmed entry goes when the last one expires), counted
    // for the predictions with ids from `born` on: an earlier one predicted an earlier life of the block
    // (removed since, then added again) and must not end this one.
    refs: u32,
    born: u64,
    stamp: u64, // when it was last touched, on the table's own clock
}

/// One endpoint's blocks: hash -> (media mask, prediction id), with least-recently-touched order.
///
/// The order is a touch stamp per entry, not a linked list: a touch is one write into the entry the
/// probe already found (a linked list relinks two neighbours, each likely a cache miss, for every one
/// of a long prompt's thousands of blocks). Only the index's bound asks for the oldest entry; it is
/// served from a batch of the oldest stamps, rebuilt by one scan when its entries run out or go stale.
#[pyclass(module = "kvstrata_native")]
struct BlockTable {
    map: FxHashMap<u64, Entry>,
    clock: u64,
    oldest: Vec<(u64, u64)>, // (stamp, hash), newest first: pop() gives the oldest
}

impl BlockTable {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Ticks the clock only for a block it finds: a miss is followed by a `put`, which ticks.
    fn touch(&mut self, h: &u64) -> Option<&mut Entry> {
        let e = self.map.get_mut(h)?;
        self.clock += 1;
        e.stamp = self.clock;
        Some(e)
    }

    fn put(&mut self, h: u64, mask: u8, refs: u32, born: u64) -> bool {
        let stamp = self.tick();
        self.map
            .insert(
                h,
                Entry {
                    mask,
                    refs,
                    born,
                    stamp,
                },
            )
            .is_none()
    }

    fn prefix_of(&mut self, hashes: &[u64]) -> (usize, usize, usize, usize, usize) {
        let (mut n, mut gpu, mut cpu, mut storage, mut predicted) = (0, 0, 0, 0, 0);
        for h in hashes {
            let Some(e) = self.touch(h) else { break };
            n += 1;
            if e.mask & GPU != 0 {
                gpu += 1;
            } else if e.mask & CPU != 0 {
                cpu += 1;
            } else if e.mask & STORAGE != 0 {
                storage += 1;
            } else {
                predicted += 1;
            }
        }
        (n, gpu, cpu, storage, predicted)
    }

    fn store_all(&mut self, hashes: &[u64], bit: u8) -> usize {
        let mut added = 0;
        for &h in hashes {
            match self.touch(&h) {
                Some(e) => e.mask = (e.mask | bit) & REAL,
                None => {
                    self.put(h, bit, 0, 0);
                    added += 1;
                }
            }
        }
        added
    }

    fn remove_all(&mut self, hashes: &[u64], bit: u8) -> (usize, Vec<u64>) {
        let mut matched = 0;
        let mut gone = Vec::new();
        for &h in hashes {
            let Some(e) = self.map.get_mut(&h) else {
                continue;
            };
            if e.mask & bit != 0 {
                matched += 1;
            }
            let mask = e.mask & !bit & REAL;
            if mask != 0 {
                e.mask = mask;
            } else {
                self.map.remove(&h);
                gone.push(h);
            }
        }
        (matched, gone)
    }

    fn predict_all(&mut self, hashes: &[u64], pred: u64, touched: usize) -> usize {
        let mut added = 0;
        for (i, &h) in hashes.iter().enumerate() {
            // The leading `touched` blocks were just touched by a lookup: most recent already.
            let found = if i >= touched {
                self.touch(&h)
            } else {
                self.map.get_mut(&h)
            };
            match found {
                Some(e) => e.refs += 1,
                None => {
                    self.put(h, PREDICTED, 1, pred);
                    added += 1;
                }
            }
        }
        added
    }

    fn expire_all(&mut self, hashes: &[u64], pred: u64) -> usize {
        let mut n = 0;
        for h in hashes {
            let Some(e) = self.map.get_mut(h) else {
                continue;
            };
            if e.born > pred || e.refs == 0 {
                continue;
            }
            e.refs -= 1;
            if e.refs == 0 && e.mask & REAL == 0 {
                self.map.remove(h);
                n += 1;
            }
        }
        n
    }
}

#[pymethods]
impl BlockTable {
    #[new]
    fn new() -> Self {
        Self {
            map: FxHashMap::default(),
            clock: 0,
            oldest: Vec::new(),
        }
    }

    fn __len__(&self) -> usize {
        self.map.len()
    }

    fn __contains__(&self, h: u64) -> bool {
        self.map.contains_key(&h)
    }

    /// The block's media mask, 0 if the table does not hold it.
    fn mask(&self, h: u64) -> u8 {
        self.map.get(&h).map_or(0, |e| e.mask)
    }

    /// The leading blocks of ``hashes`` held here, as (blocks, gpu, cpu, storage, predicted) counted by
    /// each block's best medium; the matched blocks become the most recently touched, in order.
    fn prefix(
        &mut self,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize, usize, usize, usize)> {
        with_hashes(hashes, |h| self.prefix_of(h))
    }

    /// A BlockStored on medium ``bit``: new blocks are added, known ones gain the medium and lose
    /// their prediction (confirmed). Returns how many were added.
    fn store(&mut self, hashes: &Bound<'_, PyAny>, bit: u8) -> PyResult<usize> {
        with_hashes(hashes, |h| self.store_all(h, bit))
    }

    /// A BlockRemoved on medium ``bit``: (how many of the blocks were held on that medium, the blocks
    /// now gone from every medium, which the table no longer holds).
    fn remove(&mut self, hashes: &Bound<'_, PyAny>, bit: u8) -> PyResult<(usize, Vec<u64>)> {
        with_hashes(hashes, |h| self.remove_all(h, bit))
    }

    /// Record that the endpoint will hold ``hashes`` while prediction ``pred`` lives (ids increase with
    /// every call); ``touched`` leading blocks were just touched by a lookup. New blocks are added as
    /// unconfirmed; every block gains a holder. Returns how many were added.
    fn predict(&mut self, hashes: &Bound<'_, PyAny>, pred: u64, touched: usize) -> PyResult<usize> {
        with_hashes(hashes, |h| self.predict_all(h, pred, touched))
    }

    /// Prediction ``pred`` (which predicted ``hashes``) expired: its blocks lose a holder, and the
    /// unconfirmed ones left with none are removed. Returns how many.
    fn expire(&mut self, hashes: &Bound<'_, PyAny>, pred: u64) -> PyResult<usize> {
        with_hashes(hashes, |h| self.expire_all(h, pred))
    }

    /// Remove and return the least recently touched block: (hash, mask).
    fn pop_oldest(&mut self) -> Option<(u64, u8)> {
        self.take_oldest()
    }

    /// Remove the ``n`` least recently touched blocks (fewer if the table holds fewer): (how many went,
    /// the hashes of those held on some medium, oldest first). An index over its bound by a long
    /// prompt's blocks evicts them in one call, not one Python iteration each.
    fn pop_oldest_many(&mut self, n: usize) -> (usize, Vec<u64>) {
        let mut real = Vec::new();
        let mut taken = 0;
        while taken < n {
            let Some((h, mask)) = self.take_oldest() else {
                break;
            };
            taken += 1;
            if mask & REAL != 0 {
                real.push(h);
            }
        }
        (taken, real)
    }

    fn clear(&mut self) {
        self.map.clear();
        self.oldest.clear();
    }
}

impl BlockTable {
    fn take_oldest(&mut self) -> Option<(u64, u8)> {
        loop {
            // A batch entry is stale if its block was touched (a newer stamp) or removed since; every
            // block outside the batch was newer than the whole batch when it was built, and only gets
            // newer, so the oldest valid batch entry is the oldest block.
            while let Some((stamp, h)) = self.oldest.pop() {
                if matches!(self.map.get(&h), Some(e) if e.stamp == stamp) {
                    let e = self.map.remove(&h)?;
                    return Some((h, e.mask));
                }
            }
            if self.map.is_empty() {
                return None;
            }
            let mut all: Vec<(u64, u64)> = self.map.iter().map(|(h, e)| (e.stamp, *h)).collect();
            let k = (all.len() / 8).max(64);
            if k < all.len() {
                all.select_nth_unstable(k);
                all.truncate(k);
            }
            all.sort_unstable_by(|a, b| b.cmp(a));
            self.oldest = all;
        }
    }
}

/// Block hash -> when it was last touched (a float clock that does not go back), oldest first: an
/// endpoint's recent demand. A touch is one probe and a push onto a touch-ordered queue; queue entries
/// made stale by a later touch (a newer sequence number) are skipped when they reach the front, and the
/// queue is rebuilt from the map when stale entries outnumber live ones.
#[pyclass(module = "kvstrata_native")]
struct Recency {
    map: FxHashMap<u64, u64>, // hash -> sequence number of its last touch
    queue: VecDeque<(u64, f64, u64)>, // (sequence, time, hash) in touch order
    seq: u64,
}

impl Recency {
    fn live(&self, seq: u64, h: u64) -> bool {
        self.map.get(&h) == Some(&seq)
    }
}

#[pymethods]
impl Recency {
    #[new]
    fn new() -> Self {
        Self {
            map: FxHashMap::default(),
            queue: VecDeque::new(),
            seq: 0,
        }
    }

    fn __len__(&self) -> usize {
        self.map.len()
    }

    /// Every hash of ``hashes`` was touched at ``now``: it becomes the newest. With ``limit``, at most
    /// that many hashes are kept afterwards (:meth:`trim`), so only the last ``limit`` of ``hashes`` are
    /// touched: the same state, and a 4 MB prompt's 38,000 blocks cost ``limit`` touches, not 38,000.
    #[pyo3(signature = (hashes, now, limit=None))]
    fn touch(&mut self, hashes: &Bound<'_, PyAny>, now: f64, limit: Option<usize>) -> PyResult<()> {
        with_hashes(hashes, |hashes| {
            let from = limit.map_or(0, |n| hashes.len().saturating_sub(n));
            for &h in &hashes[from..] {
                self.seq += 1;
                self.map.insert(h, self.seq);
                self.queue.push_back((self.seq, now, h));
            }
        })?;
        if let Some(n) = limit {
            self.trim(n);
        }
        if self.queue.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.queue.retain(|&(seq, _, h)| map.get(&h) == Some(&seq));
        }
        Ok(())
    }

    /// Drop the hashes touched before ``horizon``; the count left.
    fn expire_before(&mut self, horizon: f64) -> usize {
        while let Some(&(seq, t, h)) = self.queue.front() {
            if t >= horizon {
                break;
            }
            self.queue.pop_front();
            if self.live(seq, h) {
                self.map.remove(&h);
            }
        }
        self.map.len()
    }

    /// When the ``rank``-th most recently touched hash (0: the newest) was touched; None when fewer
    /// hashes are kept. An LRU pool that keeps ``rank`` of these evicts that one first among the
    /// newest, so its time says how recently used the newest block an eviction takes was.
    ///
    /// Walked from the nearer end: asked for the rank a pool of P blocks keeps past a prompt of n, with
    /// at most max(P, 1024) hashes kept, that is the oldest end, so the walk is about n long, not P.
    fn touched_at_rank(&self, rank: usize) -> Option<f64> {
        let live = self.map.len();
        if rank >= live {
            return None;
        }
        let from_oldest = live - 1 - rank;
        let time_if_live = |&(seq, t, h): &(u64, f64, u64)| self.live(seq, h).then_some(t);
        if from_oldest < rank {
            self.queue.iter().filter_map(time_if_live).nth(from_oldest)
        } else {
            self.queue.iter().rev().filter_map(time_if_live).nth(rank)
        }
    }

    /// Drop the oldest hashes past ``limit``.
    fn trim(&mut self, limit: usize) {
        while self.map.len() > limit {
            let Some((seq, _, h)) = self.queue.pop_front() else {
                break;
            };
            if self.live(seq, h) {
                self.map.remove(&h);
            }
        }
    }
}

#[pymodule]
fn kvstrata_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GPU", GPU)?;
    m.add("CPU", CPU)?;
    m.add("STORAGE", STORAGE)?;
    m.add("PREDICTED", PREDICTED)?;
    m.add_class::<BlockTable>()?;
    m.add_class::<Recency>()?;
    m.add_function(wrap_pyfunction!(digests::block_digests, m)?)?;
    m.add_class::<incremental::Encoder>()?;
    m.add_class::<incremental::Walk>()?;
    m.add_class::<followups::FollowUps>()?;
    m.add_class::<predictions::Prediction>()?;
    m.add_class::<predictions::Predictions>()?;
    m.add_class::<ranking::Ranker>()?;
    m.add_class::<rooms::Rooms>()?;
    m.add_function(wrap_pyfunction!(ranking::py_rendezvous, m)?)?;
    front::register(m)?;
    Ok(())
}
