//! router/incremental.py's encoder in Rust: prompt text → (token count, block hashes), reusing the chunks
//! of earlier prompts, with the tokenizer called here (the `tokenizers` crate the Python package wraps)
//! and no Python object per chunk, token or block.
//!
//! Python keeps the definition and the proof: which tokenizers may be cut, their fixed special tokens and
//! added tokens (`incremental.prove`) and the start-up self-check, which here also compares this crate's
//! encodes with the Python package's (the engine's). This file follows `IncrementalEncoder` step for step;
//! where it differs, it says so. Positions are UTF-8 byte offsets inside (a cut is an ASCII space, so
//! every cut is a character boundary); what Python reads back (`Walk.pos`, the probe's end, the
//! characters reused) is in characters, as the Python encoder gives them.
//!
//! Threads: the trie and the recent prompts sit behind one mutex, held for lookups and inserts only,
//! never while tokenizing or hashing and never while taking the GIL. Tokenizing more than 1 KiB runs
//! with the GIL released (`DETACH_BYTES`); a walk, or a short prompt's few µs, keeps it.

use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::{Arc, Mutex, MutexGuard};

use aho_corasick::AhoCorasick;
use hashlink::LinkedHashMap;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyBytes;
use rustc_hash::{FxHashMap, FxHasher};
use tokenizers::Tokenizer;

use crate::bytelevel::FastByteLevel;
use crate::digests;

// The Python encoder's constants, in bytes where it counts characters (the same for ASCII prompts).
const FIRST_CHUNKS_UNTIL: usize = 4096;
const TAIL_CHUNK_BYTES: usize = 64;
const RECENT_MIN_BYTES: usize = 16_384;
const RECENT_KEY_BYTES: usize = 256;
const RECENT_PER_KEY: usize = 8;
const RECENT_MAX_BYTES: usize = 16 << 20;
const MAX_KEY_LENS: usize = 32;
/// Work on more than this many bytes of new text runs with the GIL released, as the Python package's
/// encode calls always do: the rest of a prompt, hashed on a pool or background thread, must not hold up
/// the event loop (with 16 KiB here, a cold 1K-token prompt's ~4 KB rest, hashed after the decision,
/// held the GIL while the loop forwarded the request: 2.1-2.7 ms added against 1.1 in Python). Smaller
/// work (a short prompt on the loop, a few µs) keeps it: giving it up there lets a waiting thread run
/// first.
const DETACH_BYTES: usize = 1024;
// Chunks inserted, or evicted, per hold of the trie's lock (`Encoder::insert`).
const INSERT_BATCH: usize = 64;

type Fx = BuildHasherDefault<FxHasher>;

/// The block chain after some tokens: the last full block's digest and the partial block's tokens.
#[derive(Clone)]
struct State {
    tokens: usize,
    last: [u8; 32],
    leftover: Vec<i64>,
}

/// A cached chunk. Keyed by (parent node, chunk text + the context its cut depended on).
struct Node {
    id: u64,
    bytes: usize,
    chars: usize,
    hashes: Box<[u64]>,
    state: State,
}

/// A chunk's place in the trie: its parent's node id and its key text.
type TrieKey = (u64, Box<[u8]>);

#[derive(Default)]
struct Trie {
    nodes: LinkedHashMap<TrieKey, Node, Fx>, // least recently used first
    key_lens: FxHashMap<u64, Vec<usize>>,    // parent -> its children's key lengths, newest first
    bytes: usize,
    next_id: u64,
}

impl Trie {
    fn hash_of(&self, parent: u64, key: &[u8]) -> u64 {
        // The same hash the map computes for its `(u64, Box<[u8]>)` keys: Box<[u8]> hashes as [u8].
        self.nodes.hasher().hash_one((parent, key))
    }

    fn get(&self, parent: u64, key: &[u8]) -> Option<&Node> {
        let h = self.hash_of(parent, key);
        self.nodes
            .raw_entry()
            .from_hash(h, |k| k.0 == parent && *k.1 == *key)
            .map(|(_, v)| v)
    }

    fn touch(&mut self, parent: u64, key: &[u8]) {
        let h = self.hash_of(parent, key);
        if let hashlink::linked_hash_map::RawEntryMut::Occupied(mut e) = self
            .nodes
            .raw_entry_mut()
            .from_hash(h, |k| k.0 == parent && *k.1 == *key)
        {
            e.to_back();
        }
    }
}

#[derive(Clone)]
struct WalkData {
    pos: usize,   // bytes covered by cached chunks
    chars: usize, // ... in characters
    state: State,
    hashes: Vec<u64>,
    parent: u64,
    base: Option<Arc<[u8]>>, // the remembered long prompt the walk started from
}

/// The cached chunks a prompt starts with (`IncrementalEncoder.walk`'s result).
#[pyclass(module = "kvstrata_native", frozen)]
pub struct Walk {
    data: WalkData,
}

#[pymethods]
impl Walk {
    /// Characters covered by cached chunks (the Python encoder's unit).
    #[getter(pos)]
    fn chars(&self) -> usize {
        self.data.chars
    }

    /// Tokens up to `pos` (the special tokens before the text included).
    #[getter]
    fn tokens(&self) -> usize {
        self.data.state.tokens
    }

    /// The block hashes of the cached chunks, as an ``array('Q')``.
    #[getter]
    fn hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        hash_array(py, &self.data.hashes)
    }
}

static ARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// ``array('Q', hashes)``: the router's hash chains (router/hashing.py `chain`).
fn hash_array<'py>(py: Python<'py>, hashes: &[u64]) -> PyResult<Bound<'py, PyAny>> {
    let array = ARRAY.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("array")?.getattr("array")?.unbind())
    })?;
    let bytes: Vec<u8> = hashes.iter().flat_map(|h| h.to_ne_bytes()).collect();
    array.bind(py).call1(("Q", PyBytes::new(py, &bytes)))
}

fn count_chars(b: &[u8]) -> usize {
    b.iter().filter(|&&c| (c as i8) >= -0x40).count() // every byte but UTF-8 continuation bytes
}

fn tokenizer_error(e: tokenizers::Error) -> PyErr {
    PyRuntimeError::new_err(format!("tokenizer: {e}"))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A recent long prompt (its chunked prefix, by value) and the walk to its end.
type Recent = (Arc<[u8]>, WalkData);

struct Inner {
    trie: Trie,
    recent: LinkedHashMap<Box<[u8]>, Vec<Recent>>, // prompt[..RECENT_KEY_BYTES] -> newest first
    recent_bytes: usize,
}

/// A new chunk found by `finish`: its key text (with context), its hashes, the state after it, its size.
struct NewChunk {
    key: Box<[u8]>,
    hashes: Box<[u64]>,
    state: State,
    bytes: usize,
    chars: usize,
}

/// What `probe` found: the hashes up to the stretch's end, the tokens and characters up to it.
type Probed = (Vec<u64>, usize, usize);

/// Prompt text → (token count, block hashes), reusing the chunks of earlier prompts
/// (router/incremental.py `IncrementalEncoder`, whose proof and self-check the caller ran).
#[pyclass(module = "kvstrata_native", frozen)]
pub struct Encoder {
    tok: Tokenizer,
    enabled: bool, // the tokenizer may be cut (else every prompt is encoded whole, nothing cached)
    add_special: bool,
    block_size: usize,
    cbor: bool,
    root: State,
    prefix: Vec<i64>,
    suffix: Vec<i64>,
    added: Option<AhoCorasick>,
    reach: usize,
    chunk: usize,
    first_chunk: usize,
    max_cached: usize,
    inner: Mutex<Inner>,
    // Pieces without special tokens, ASCII and free of added tokens, split by hand (src/bytelevel.rs)
    // where the tokenizer is GPT-2's byte-level BPE; with the tokenizer's own added tokens.
    fast: Option<(FastByteLevel, Option<AhoCorasick>)>,
    busy: std::sync::atomic::AtomicU64, // short prompts encoded whole: the trie's lock was held
}

impl Encoder {
    fn ids(&self, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        if let (false, Some((fast, added))) = (add_special, &self.fast) {
            if added.as_ref().is_none_or(|ac| !ac.is_match(text)) {
                if !text.is_ascii() && self.enabled {
                    return self.mixed_ids(fast, text);
                }
                if let Some(got) = fast.ids(self.tok.get_model(), text) {
                    return got.map_err(tokenizer_error);
                }
            }
        }
        self.pipeline_ids(text, add_special)
    }

    fn pipeline_ids(&self, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        self.tok
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(tokenizer_error)
    }

    /// The ids of a piece (no special tokens, no added token) with some text that is not ASCII. It is
    /// cut at every safe cut (where the proof says a cut changes no id), and each stretch between cuts
    /// that is ASCII is split by hand; the others go through the pipeline, neighbours together. So one
    /// curly quote or accented name costs its own stretch the pipeline, not the whole chunk (by hand,
    /// ASCII text tokenizes about 12 times faster: 3.4 against 40.6 ms for 100 KB here).
    fn mixed_ids(&self, fast: &FastByteLevel, text: &str) -> PyResult<Vec<u32>> {
        let t = text.as_bytes();
        let mut bounds = vec![0];
        bounds.extend(self.cuts(t, 0, Some(1)));
        bounds.push(t.len());
        let mut out = Vec::with_capacity(t.len() / 3 + 1);
        let mut from = 0;
        let mut ascii = t[..bounds[1]].is_ascii();
        for ab in bounds.windows(2) {
            let here = t[ab[0]..ab[1]].is_ascii();
            if here != ascii {
                out.extend(self.stretch_ids(fast, &text[from..ab[0]], ascii)?);
                (from, ascii) = (ab[0], here);
            }
        }
        out.extend(self.stretch_ids(fast, &text[from..], ascii)?);
        Ok(out)
    }

    fn stretch_ids(&self, fast: &FastByteLevel, text: &str, ascii: bool) -> PyResult<Vec<u32>> {
        match ascii
            .then(|| fast.ids(self.tok.get_model(), text))
            .flatten()
        {
            Some(got) => got.map_err(tokenizer_error),
            None => self.pipeline_ids(text, false),
        }
    }

    /// The first safe cut in ``[pos, end)``: an ASCII space after an ASCII letter or digit and before an
    /// ASCII letter, with no added token within reach.
    fn cut_at_or_after(&self, t: &[u8], mut pos: usize, end: isize) -> Option<usize> {
        pos = pos.max(1);
        while (pos as isize) < end {
            let off = memchr::memchr(b' ', &t[pos..end as usize])?;
            let c = pos + off;
            if t[c - 1].is_ascii_alphanumeric() && t[c + 1].is_ascii_alphabetic() {
                let clear = match &self.added {
                    None => true,
                    Some(ac) => {
                        let window =
                            &t[c.saturating_sub(self.reach)..(c + self.reach + 1).min(t.len())];
                        !ac.is_match(window)
                    }
                };
                if clear {
                    return Some(c);
                }
            }
            pos = c + 1;
        }
        None
    }

    fn end_of_cuts(&self, t: &[u8]) -> isize {
        t.len() as isize - self.reach as isize - 1
    }

    /// Cut points after ``start``, each at least ``step`` (default: the chunk size) after the last.
    fn cuts(&self, t: &[u8], start: usize, step: Option<usize>) -> Vec<usize> {
        let end = self.end_of_cuts(t);
        let mut out = Vec::new();
        let mut pos = start;
        loop {
            let size = step.unwrap_or(if pos < FIRST_CHUNKS_UNTIL {
                self.first_chunk
            } else {
                self.chunk
            });
            match self.cut_at_or_after(t, (pos + size).max(1), end) {
                None => return out,
                Some(c) => {
                    out.push(c);
                    pos = c;
                }
            }
        }
    }

    fn digests(&self, tokens: &[i64], parent: [u8; 32]) -> Vec<[u8; 32]> {
        let whole = tokens.len() / self.block_size * self.block_size;
        digests::chain(&tokens[..whole], self.block_size, parent, self.cbor)
    }

    fn walk_inner(&self, text: &str, blocking: bool) -> Option<WalkData> {
        if !self.enabled {
            let state = State {
                tokens: 0,
                last: self.root.last,
                leftover: Vec::new(),
            };
            return Some(WalkData {
                pos: 0,
                chars: 0,
                state,
                hashes: Vec::new(),
                parent: 0,
                base: None,
            });
        }
        let t = text.as_bytes();
        let mut inner = self.hold(blocking)?;
        let mut w = WalkData {
            pos: 0,
            chars: 0,
            state: self.root.clone(),
            hashes: Vec::new(),
            parent: 0,
            base: None,
        };
        // A long prompt that extends a recent one starts where that one's chunks ended (the longest such).
        if t.len() > RECENT_MIN_BYTES {
            let mut best: Option<&Recent> = None;
            if let Some(entries) = inner.recent.get(&t[..RECENT_KEY_BYTES]) {
                for e in entries {
                    if best.is_none_or(|b| e.1.pos > b.1.pos) && t.starts_with(&e.0) {
                        best = Some(e);
                    }
                }
            }
            if let Some((prefix, bw)) = best {
                w = bw.clone();
                w.base = Some(prefix.clone());
            }
        }
        let trie = &mut inner.trie;
        let mut path: Vec<(u64, usize, usize)> = Vec::new(); // (parent, key start, key length)
        loop {
            let mut next: Option<(&Node, usize)> = None;
            if let Some(lens) = trie.key_lens.get(&w.parent) {
                for &n in lens {
                    let key = &t[w.pos..(w.pos + n).min(t.len())];
                    if let Some(node) = trie.get(w.parent, key) {
                        next = Some((node, key.len()));
                        break;
                    }
                }
            }
            let Some((node, key_len)) = next else { break };
            path.push((w.parent, w.pos, key_len));
            w.hashes.extend_from_slice(&node.hashes);
            w.parent = node.id;
            w.pos += node.bytes;
            w.chars += node.chars;
            w.state = node.state.clone();
        }
        // Most recently used last, parents after their children: eviction takes leaves first.
        for &(parent, start, len) in path.iter().rev() {
            trie.touch(parent, &t[start..start + len]);
        }
        Some(w)
    }

    fn probe_inner(&self, text: &str, w: &WalkData, chars: usize) -> PyResult<Option<Probed>> {
        check_walk(text, w)?;
        if !self.enabled {
            return Ok(None);
        }
        let t = text.as_bytes();
        let Some(cut) = self.cut_at_or_after(t, w.pos + chars.max(1), self.end_of_cuts(t)) else {
            return Ok(None);
        };
        let ids = self.ids(&text[w.pos..cut], false)?;
        let mut tokens = w.state.leftover.clone();
        tokens.extend(ids.iter().map(|&i| i as i64));
        let mut out = w.hashes.clone();
        out.extend(
            self.digests(&tokens, w.state.last)
                .iter()
                .map(digests::to_external),
        );
        Ok(Some((
            out,
            w.state.tokens + ids.len(),
            w.chars + count_chars(&t[w.pos..cut]),
        )))
    }

    /// One whole encode, hashed from the root: the ids a cut encode gives too, with nothing cached.
    fn whole(&self, text: &str) -> PyResult<(usize, Vec<u64>, usize)> {
        let ids: Vec<i64> = if self.enabled {
            // The proof's fixed specials around the text's own ids (its pieces split by hand).
            let body = self.ids(text, false)?;
            let mut ids = self.prefix.clone();
            ids.extend(body.into_iter().map(i64::from));
            ids.extend_from_slice(&self.suffix);
            ids
        } else {
            self.ids(text, self.add_special)?
                .into_iter()
                .map(i64::from)
                .collect()
        };
        let hashes = self
            .digests(&ids, self.root.last)
            .iter()
            .map(digests::to_external)
            .collect();
        Ok((ids.len(), hashes, 0))
    }

    /// The trie's lock; with ``wait`` off, None while another thread holds it.
    fn hold(&self, wait: bool) -> Option<MutexGuard<'_, Inner>> {
        if wait {
            return Some(lock(&self.inner));
        }
        match self.inner.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// ``wait`` off: the caller holds the GIL (a short prompt on the event loop), so it never waits for
    /// the trie's lock; its new chunks are not cached if another thread holds it.
    fn finish_inner(
        &self,
        text: &str,
        w: &WalkData,
        wait: bool,
    ) -> PyResult<(usize, Vec<u64>, usize)> {
        check_walk(text, w)?;
        if !self.enabled {
            return self.whole(text);
        }
        let t = text.as_bytes();
        let pos = w.pos;
        let mut cuts = self.cuts(t, pos, None);
        // One more cut within TAIL_CHUNK_BYTES of the end, so the next turn re-tokenizes only that much.
        let start = cuts.last().copied().unwrap_or(pos);
        let limit = self.end_of_cuts(t);
        let from = (start as isize + 1)
            .max(limit - TAIL_CHUNK_BYTES as isize)
            .max(0) as usize;
        match self.cut_at_or_after(t, from, limit) {
            Some(c) => cuts.push(c),
            None => cuts.extend(self.cuts(t, start, Some(TAIL_CHUNK_BYTES))),
        }
        let mut bounds = Vec::with_capacity(cuts.len() + 2);
        bounds.push(pos);
        bounds.extend(cuts);
        bounds.push(t.len());
        // One digest pass over all the new tokens; each piece's chain state is read off where it ends.
        let bs = self.block_size;
        let state = &w.state;
        let before = state.tokens - state.leftover.len();
        let mut tokens: Vec<i64> = state.leftover.clone();
        let mut ends: Vec<usize> = Vec::with_capacity(bounds.len());
        for ab in bounds.windows(2) {
            let ids = self.ids(&text[ab[0]..ab[1]], false)?;
            tokens.extend(ids.iter().map(|&i| i as i64));
            ends.push(tokens.len());
        }
        ends.pop(); // every piece but the last ends a chunk
        tokens.extend_from_slice(&self.suffix);
        let digests = self.digests(&tokens, state.last);
        let got: Vec<u64> = digests.iter().map(digests::to_external).collect();
        let ctx = self.reach + 2;
        let mut new: Vec<NewChunk> = Vec::with_capacity(ends.len());
        let (mut last, mut done) = (state.last, 0usize);
        let mut chunked_state = state.clone();
        let mut chunked_chars = w.chars;
        for (ab, &stop) in bounds.windows(2).zip(ends.iter()) {
            let (a, b) = (ab[0], ab[1]);
            let full = stop / bs;
            if full > 0 {
                last = digests[full - 1];
            }
            chunked_state = State {
                tokens: before + stop,
                last,
                leftover: tokens[full * bs..stop].to_vec(),
            };
            let chars = count_chars(&t[a..b]);
            chunked_chars += chars;
            new.push(NewChunk {
                key: t[a..(b + ctx).min(t.len())].into(),
                hashes: got[done..full].into(),
                state: chunked_state.clone(),
                bytes: b - a,
                chars,
            });
            done = full;
        }
        let mut hashes = w.hashes.clone();
        hashes.extend_from_slice(&got);
        let chunked_pos = bounds[bounds.len() - 2];
        // A long prompt's copies are made before the lock is taken (a 4 MB prompt: 4 MB and its hashes).
        let remembered = (chunked_pos > RECENT_MIN_BYTES).then(|| {
            // The whole prompt: one that starts with all of it shares the context.
            let prefix: Arc<[u8]> = t.into();
            (prefix, hashes[..w.hashes.len() + done].to_vec())
        });
        let parent = if new.is_empty() {
            Some(w.parent)
        } else {
            self.insert(w.parent, new, wait)
        };
        if let (Some(parent), Some((prefix, walked_hashes))) = (parent, remembered) {
            // The walk to the last cut, kept only for a long prompt (most prompts are not remembered).
            let chunked = WalkData {
                pos: chunked_pos,
                chars: chunked_chars,
                state: chunked_state,
                hashes: walked_hashes,
                parent,
                base: None,
            };
            if let Some(mut inner) = self.hold(wait) {
                let forgotten = remember(&mut inner, prefix, chunked, w.base.as_ref());
                drop(inner);
                drop(forgotten);
            }
        }
        Ok((before + tokens.len(), hashes, w.chars))
    }

    /// Caches the new chunks under ``parent``; the last one's node id, or None when ``wait`` is off and
    /// another thread held the lock before all were cached.
    fn insert(&self, mut parent: u64, new: Vec<NewChunk>, wait: bool) -> Option<u64> {
        // A batch of chunks per hold of the lock, and what they evict freed after it, so a long
        // prompt's thousands of chunks do not keep the lock from the other threads in one hold.
        let mut chunks = new.into_iter().peekable();
        while chunks.peek().is_some() {
            // Without ``wait`` a busy lock ends the caching here (the chunks cached so far stay).
            let mut inner = self.hold(wait)?;
            let trie = &mut inner.trie;
            for c in chunks.by_ref().take(INSERT_BATCH) {
                let key_len = c.key.len();
                let id = match trie.get(parent, &c.key) {
                    Some(node) => node.id,
                    None => {
                        trie.next_id += 1;
                        let id = trie.next_id;
                        let node = Node {
                            id,
                            bytes: c.bytes,
                            chars: c.chars,
                            hashes: c.hashes,
                            state: c.state,
                        };
                        trie.nodes.insert((parent, c.key), node);
                        trie.bytes += key_len;
                        let lens = trie.key_lens.entry(parent).or_default();
                        if !lens.contains(&key_len) {
                            lens.insert(0, key_len);
                            lens.truncate(MAX_KEY_LENS);
                        }
                        id
                    }
                };
                parent = id;
            }
            let evicted = self.evict(trie);
            drop(inner);
            drop(evicted);
        }
        // What is left over the bound (other threads insert meanwhile), a batch per hold; without
        // ``wait``, only while the lock is free (a later insert evicts the rest).
        while let Some(mut inner) = self.hold(wait) {
            let evicted = self.evict(&mut inner.trie);
            drop(inner);
            if evicted.len() < INSERT_BATCH {
                break;
            }
        }
        Some(parent)
    }

    /// Up to [`INSERT_BATCH`] least recently used chunks while the trie is over its bound, to be
    /// dropped by the caller once it let go of the lock.
    fn evict(&self, trie: &mut Trie) -> Vec<(TrieKey, Node)> {
        let mut out = Vec::new();
        while trie.bytes > self.max_cached && out.len() < INSERT_BATCH {
            let Some(old) = trie.nodes.pop_front() else {
                break;
            };
            trie.bytes -= old.0 .1.len();
            out.push(old);
        }
        if !out.is_empty() && trie.key_lens.len() > 2 * trie.nodes.len() + 16 {
            let live: rustc_hash::FxHashSet<u64> = trie.nodes.keys().map(|k| k.0).collect();
            trie.key_lens.retain(|p, _| live.contains(p));
        }
        out
    }
}

/// One pass that finds any of `tokens` (non-empty strings) in a text; None for no tokens.
fn finder(tokens: &[String]) -> PyResult<Option<AhoCorasick>> {
    if tokens.is_empty() {
        return Ok(None);
    }
    AhoCorasick::new(tokens)
        .map(Some)
        .map_err(|e| PyValueError::new_err(format!("added tokens: {e}")))
}

/// ``f`` with the GIL released when it works on more than [`DETACH_BYTES`].
fn detach<T: Send>(py: Python<'_>, bytes: usize, f: impl FnOnce() -> T + Send) -> T {
    if bytes > DETACH_BYTES {
        py.detach(f)
    } else {
        f()
    }
}

/// A walk is only finished or probed with the text it walked (else its position may not be in it).
fn check_walk(text: &str, w: &WalkData) -> PyResult<()> {
    if text.is_char_boundary(w.pos) {
        Ok(())
    } else {
        Err(PyValueError::new_err("the walk is not of this text"))
    }
}

/// Keeps where a long prompt ends its chunks, for the next turn that extends it; ``base`` (the remembered
/// prompt its walk started from) is superseded by it. Returns what it forgot, for the caller to drop
/// once it let go of the lock.
fn remember(
    inner: &mut Inner,
    prefix: Arc<[u8]>,
    walked: WalkData,
    base: Option<&Arc<[u8]>>,
) -> Vec<Vec<Recent>> {
    let key: Box<[u8]> = prefix[..RECENT_KEY_BYTES].into();
    let before = inner.recent.remove(&key).unwrap_or_default();
    let old_bytes: usize = before.iter().map(|(p, _)| p.len()).sum();
    let mut entries: Vec<Recent> = Vec::with_capacity(RECENT_PER_KEY);
    let mut forgotten: Vec<Vec<Recent>> = Vec::new();
    entries.push((prefix, walked));
    let (kept, superseded): (Vec<Recent>, Vec<Recent>) = before
        .into_iter()
        .partition(|(p, _)| base.is_none_or(|b| !Arc::ptr_eq(p, b)));
    forgotten.push(superseded);
    entries.extend(kept);
    if entries.len() > RECENT_PER_KEY {
        forgotten.push(entries.split_off(RECENT_PER_KEY));
    }
    let new_bytes: usize = entries.iter().map(|(p, _)| p.len()).sum();
    inner.recent.insert(key, entries);
    inner.recent_bytes = inner.recent_bytes + new_bytes - old_bytes;
    while inner.recent_bytes > RECENT_MAX_BYTES {
        let Some((_, old)) = inner.recent.pop_front() else {
            break;
        };
        inner.recent_bytes -= old.iter().map(|(p, _)| p.len()).sum::<usize>();
        forgotten.push(old);
    }
    forgotten
}

#[pymethods]
impl Encoder {
    #[new]
    #[pyo3(signature = (
        tokenizer_json, *, add_special_tokens, block_size, algo, none_hash, prefix, suffix, added,
        enabled, chunk_chars, first_chunk_chars, max_cached_chars
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        tokenizer_json: &str,
        add_special_tokens: bool,
        block_size: usize,
        algo: &str,
        none_hash: &[u8],
        prefix: Vec<i64>,
        suffix: Vec<i64>,
        added: Vec<String>,
        enabled: bool,
        chunk_chars: usize,
        first_chunk_chars: usize,
        max_cached_chars: usize,
    ) -> PyResult<Self> {
        let cbor = digests::is_cbor(algo)?;
        digests::check_block_size(block_size, cbor)?;
        let last: [u8; 32] = none_hash
            .try_into()
            .map_err(|_| PyValueError::new_err("none_hash must be a 32-byte digest"))?;
        let tok: Tokenizer = tokenizer_json
            .parse()
            .map_err(|e| PyValueError::new_err(format!("cannot load the tokenizer: {e}")))?;
        let added: Vec<String> = added.into_iter().filter(|a| !a.is_empty()).collect();
        let reach = added.iter().map(|a| a.len()).max().unwrap_or(0) + 1;
        let ac = finder(&added)?;
        let (prefix, suffix) = if add_special_tokens {
            (prefix, suffix)
        } else {
            (vec![], vec![])
        };
        let chunk = chunk_chars.max(1);
        let fast = match FastByteLevel::of(&tok) {
            None => None,
            Some(fast) => {
                let own: Vec<String> = tok
                    .get_added_tokens_decoder()
                    .into_values()
                    .map(|t| t.content)
                    .filter(|c| !c.is_empty())
                    .collect();
                Some((fast, finder(&own)?))
            }
        };
        Ok(Encoder {
            tok,
            enabled,
            add_special: add_special_tokens,
            block_size,
            cbor,
            root: State {
                tokens: prefix.len(),
                last,
                leftover: prefix.clone(),
            },
            prefix,
            suffix,
            added: ac,
            reach,
            chunk,
            first_chunk: first_chunk_chars.clamp(1, chunk),
            max_cached: max_cached_chars,
            inner: Mutex::new(Inner {
                trie: Trie::default(),
                recent: LinkedHashMap::new(),
                recent_bytes: 0,
            }),
            fast,
            busy: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The cached chunks ``text`` starts with; None if ``blocking`` is off and another thread holds them.
    #[pyo3(signature = (text, blocking = true))]
    fn walk(&self, text: &str, blocking: bool) -> Option<Walk> {
        // With the GIL held, as the Python walk: it runs on the event loop (prompts up to 1 Mi characters;
        // a longer one is encoded in the pools), a comparison and a lookup per chunk, and giving the GIL
        // up there would let any thread waiting for it run first, up to a switch interval.
        self.walk_inner(text, blocking).map(|data| Walk { data })
    }

    /// Tokenizes and hashes what ``walked`` did not find and caches its chunks:
    /// (tokens, block hashes as ``array('Q')``, characters reused).
    fn finish<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        walked: &Walk,
    ) -> PyResult<(usize, Bound<'py, PyAny>, usize)> {
        let w = &walked.data;
        let new = text.len().saturating_sub(w.pos);
        let (n, hashes, reused) =
            detach(py, new, || self.finish_inner(text, w, new > DETACH_BYTES))?;
        Ok((n, hash_array(py, &hashes)?, reused))
    }

    /// Tokenizes and hashes only the stretch after ``walked`` to the first safe cut at least ``chars``
    /// bytes on, caching nothing: (hashes, tokens to its end, characters to its end), or None.
    fn probe<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        walked: &Walk,
        chars: usize,
    ) -> PyResult<Option<(Bound<'py, PyAny>, usize, usize)>> {
        let w = &walked.data;
        match detach(py, chars, || self.probe_inner(text, w, chars))? {
            None => Ok(None),
            Some((hashes, tokens, at)) => Ok(Some((hash_array(py, &hashes)?, tokens, at))),
        }
    }

    /// (tokens, block hashes, characters reused) of ``text``: a walk and its finish.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        text: &str,
    ) -> PyResult<(usize, Bound<'py, PyAny>, usize)> {
        // A short prompt is encoded holding the GIL (on the event loop): it never waits for the trie's
        // lock, which a long prompt's walk or inserts on another thread may hold for milliseconds while
        // every request waits for the GIL (the slowest short request beside a 4 MB prompt in `make
        // bench-router-overhead` took 30-39 ms). If the lock is busy it is encoded whole, uncached.
        let wait = text.len() > DETACH_BYTES;
        let (n, hashes, reused) = detach(py, text.len(), || match self.walk_inner(text, wait) {
            Some(w) => self.finish_inner(text, &w, wait),
            None => {
                self.busy.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.whole(text)
            }
        })?;
        Ok((n, hash_array(py, &hashes)?, reused))
    }

    /// The ids of a whole encode by this crate's tokenizer (for the self-check against the engine's).
    fn full_ids(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        detach(py, text.len(), || self.ids(text, self.add_special))
    }

    /// The ids assembled from chunks cut every ``step`` bytes (default: the chunk sizes).
    #[pyo3(signature = (text, step = None))]
    fn chunked_ids(&self, py: Python<'_>, text: &str, step: Option<usize>) -> PyResult<Vec<u32>> {
        if !self.enabled {
            return self.full_ids(py, text);
        }
        detach(py, text.len(), || {
            let mut bounds = vec![0];
            bounds.extend(self.cuts(text.as_bytes(), 0, step));
            bounds.push(text.len());
            let mut out: Vec<u32> = self.prefix.iter().map(|&i| i as u32).collect();
            for ab in bounds.windows(2) {
                out.extend(self.ids(&text[ab[0]..ab[1]], false)?);
            }
            out.extend(self.suffix.iter().map(|&i| i as u32));
            Ok(out)
        })
    }

    /// The ids of one piece between cuts (no special tokens), as the encoder tokenizes it.
    fn piece_ids(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        detach(py, text.len(), || self.ids(text, false))
    }

    /// Whether pieces are split by hand (src/bytelevel.rs) where they can be.
    #[getter]
    fn fast_pieces(&self) -> bool {
        self.fast.is_some()
    }

    /// (cached chunks, bytes of chunk keys cached, remembered long prompts, short prompts encoded whole
    /// because another thread held the chunk cache).
    fn stats(&self) -> (usize, usize, usize, u64) {
        let inner = lock(&self.inner);
        (
            inner.trie.nodes.len(),
            inner.trie.bytes,
            inner.recent.values().map(Vec::len).sum(),
            self.busy.load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}
