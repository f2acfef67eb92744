//! router/admission.py's rooms in Rust: per engine, the distinct blocks the router's running requests
//! pin there (alone, and with the rooms kept for follow-ups), and the kept rooms themselves. The gate
//! (router/admission.py, `Gate`) decides; this keeps the counts it asks about.
//!
//! Every request admitted changes these counts twice and every one that ends twice more, and the Python
//! version of them (sorted tries of byte keys, reservations as objects in two lists) was about 45 Python
//! calls per request, the gate's largest share of the router's CPU under bench-proxy. One call here
//! does the work of each of those groups. The admission tests check every count against the plain
//! computation (sort the claims, sum what neighbours do not share) through random claims, releases,
//! kept rooms taken and expired.

use std::collections::VecDeque;

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use rustc_hash::FxHashMap;

use crate::with_hashes;

/// Leading blocks two prompts share: their chained hashes agree on a leading run only.
fn common(a: &[u64], b: &[u64]) -> i64 {
    a.iter().zip(b).take_while(|(x, y)| x == y).count() as i64
}

/// One engine's claims as sorted keys (their block hashes). Sorted, prompts sharing a prefix stand
/// together, so the blocks they pin together are their total less what each shares with the one before
/// it, and a change touches only its neighbours.
#[derive(Clone, Default)]
struct Trie {
    keys: Vec<Box<[u64]>>,
    total: i64,  // every claim's blocks, a shared prefix counted as often as it is pinned
    shared: i64, // blocks each key shares with the one before it, summed
}

impl Trie {
    fn distinct(&self) -> i64 {
        self.total - self.shared
    }

    fn at(&self, key: &[u64]) -> usize {
        self.keys.partition_point(|k| &**k < key)
    }

    /// What ``key``, standing at ``at`` between its neighbours, adds to ``shared``.
    fn shared_at(&self, at: usize, key: &[u64]) -> i64 {
        let before = at.checked_sub(1).map(|i| &*self.keys[i]);
        let after = self.keys.get(at).map(|k| &**k);
        let mut added = before.map_or(0, |b| common(b, key));
        if let Some(a) = after {
            added += common(key, a);
            if let Some(b) = before {
                added -= common(b, a);
            }
        }
        added
    }

    fn add(&mut self, key: &[u64], blocks: i64) {
        let at = self.at(key);
        self.shared += self.shared_at(at, key);
        self.keys.insert(at, key.into());
        self.total += blocks;
    }

    /// Whether ``key`` was there (any one of equal keys: each leaves the same trie).
    fn remove(&mut self, key: &[u64], blocks: i64) -> bool {
        let at = self.at(key);
        if self.keys.get(at).is_none_or(|k| **k != *key) {
            return false;
        }
        self.keys.remove(at);
        self.shared -= self.shared_at(at, key);
        self.total -= blocks;
        true
    }

    fn distinct_with(&self, key: &[u64], blocks: i64) -> i64 {
        self.distinct() + blocks - self.shared_at(self.at(key), key)
    }

    /// The most leading blocks ``key`` shares with one key: the one sharing most stands beside it.
    fn longest_shared(&self, key: &[u64]) -> i64 {
        let at = self.at(key);
        let before = at.checked_sub(1).map_or(0, |i| common(key, &self.keys[i]));
        let after = self.keys.get(at).map_or(0, |k| common(key, k));
        before.max(after)
    }
}

/// An ended request's room on its engine, kept for its follow-up until ``until`` (monotonic).
struct Room {
    url: String,
    endpoint: Py<PyAny>,
    key: Box<[u64]>,
    blocks: i64,
    until: f64,
}

#[derive(Default)]
struct Engine {
    running: Trie,
    kept: Trie,                  // running and kept rooms
    rooms: VecDeque<(u64, f64)>, // (room id, until), in order of expiry; closed ones until they expire
}

#[pyclass(module = "kvstrata_native")]
#[derive(Default)]
pub struct Rooms {
    engines: FxHashMap<String, Engine>,
    open: FxHashMap<u64, Room>,
    by_last: FxHashMap<u64, VecDeque<u64>>, // open rooms by their prompt's last block hash, oldest first
    next_room: u64,
    // During a gate pass: the running tries as the pass began of the engines whose claims it changed.
    frozen: Option<FxHashMap<String, Trie>>,
}

impl Rooms {
    fn engine(&mut self, url: &str) -> &mut Engine {
        if !self.engines.contains_key(url) {
            self.engines.insert(url.to_owned(), Engine::default());
        }
        self.engines.get_mut(url).expect("just inserted")
    }

    /// In a pass, keep ``url``'s running trie as the pass began before it changes.
    fn freeze(&mut self, url: &str) {
        if let Some(frozen) = &mut self.frozen {
            if !frozen.contains_key(url) {
                let running = self
                    .engines
                    .get(url)
                    .map(|e| e.running.clone())
                    .unwrap_or_default();
                frozen.insert(url.to_owned(), running);
            }
        }
    }

    /// ``url``'s running trie: as the pass began, in a pass; else now.
    fn running_at(&self, url: &str) -> Option<&Trie> {
        if let Some(t) = self.frozen.as_ref().and_then(|f| f.get(url)) {
            return Some(t);
        }
        self.engines.get(url).map(|e| &e.running)
    }

    fn close(&mut self, id: u64) {
        let Some(room) = self.open.remove(&id) else {
            return;
        };
        if let Some(e) = self.engines.get_mut(&room.url) {
            e.kept.remove(&room.key, room.blocks);
        }
        let last = *room.key.last().unwrap_or(&0);
        if let Some(same) = self.by_last.get_mut(&last) {
            if let Some(i) = same.iter().position(|&r| r == id) {
                same.remove(i);
            }
            if same.is_empty() {
                self.by_last.remove(&last);
            }
        }
    }

    fn expire_at(&mut self, url: &str, now: f64) {
        let Some(e) = self.engines.get_mut(url) else {
            return;
        };
        let mut ended = Vec::new();
        while let Some(&(id, until)) = e.rooms.front() {
            if until > now {
                break;
            }
            e.rooms.pop_front();
            ended.push(id);
        }
        for id in ended {
            self.close(id);
        }
    }

    fn fits_now(
        &mut self,
        url: &str,
        kv_blocks: i64,
        key: &[u64],
        blocks: i64,
        kept: bool,
        now: f64,
    ) -> bool {
        if kv_blocks <= 0 {
            return true;
        }
        if kept {
            self.expire_at(url, now);
        }
        let Some(e) = self.engines.get(url) else {
            return true;
        };
        let trie = if kept { &e.kept } else { &e.running };
        if trie.keys.is_empty() {
            return true;
        }
        let pool = kv_blocks - 1; // vLLM keeps one block of its pool as the null block
        trie.total + blocks <= pool || trie.distinct_with(key, blocks) <= pool
    }

    fn pin_key(&mut self, url: &str, key: &[u64], blocks: i64) {
        self.freeze(url);
        let e = self.engine(url);
        e.running.add(key, blocks);
        e.kept.add(key, blocks);
    }
}

fn not_pinned(url: &str) -> PyErr {
    PyKeyError::new_err(format!("no such claim pinned on {url}"))
}

#[pymethods]
impl Rooms {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// A request with these prompt block hashes pins ``blocks`` on ``url`` until it is unpinned.
    fn pin(&mut self, url: &str, hashes: &Bound<'_, PyAny>, blocks: i64) -> PyResult<()> {
        with_hashes(hashes, |h| self.pin_key(url, h, blocks))
    }

    /// :meth:`pin` where ``blocks`` more fit on ``url`` (a pool of ``kv_blocks``, 0 when unknown;
    /// ``kept``: the rooms kept there counted as taken); whether they did.
    #[pyo3(signature = (url, kv_blocks, hashes, blocks, now, *, kept=true))]
    fn pin_if_fits(
        &mut self,
        url: &str,
        kv_blocks: i64,
        hashes: &Bound<'_, PyAny>,
        blocks: i64,
        now: f64,
        kept: bool,
    ) -> PyResult<bool> {
        with_hashes(hashes, |h| {
            let fits = self.fits_now(url, kv_blocks, h, blocks, kept, now);
            if fits {
                self.pin_key(url, h, blocks);
            }
            fits
        })
    }

    /// The request no longer runs on ``url``. With ``until`` its room is kept for its follow-up until
    /// then (its blocks stay counted among the kept, and :meth:`take` finds it as ``endpoint``);
    /// rooms there that ended by ``now`` close first.
    #[pyo3(signature = (url, hashes, blocks, endpoint=None, until=None, now=0.0))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one call per ended request
    fn unpin(
        &mut self,
        py: Python<'_>,
        url: &str,
        hashes: &Bound<'_, PyAny>,
        blocks: i64,
        endpoint: Option<Py<PyAny>>,
        until: Option<f64>,
        now: f64,
    ) -> PyResult<()> {
        with_hashes(hashes, |h| {
            self.freeze(url);
            let e = self.engines.get_mut(url).ok_or_else(|| not_pinned(url))?;
            if !e.running.remove(h, blocks) {
                return Err(not_pinned(url));
            }
            let (Some(until), Some(endpoint)) = (until, endpoint) else {
                e.kept.remove(h, blocks);
                return Ok(());
            };
            // Rooms close as they expire wherever they are counted; where every request is a follow-up
            // taking its own room (an agent's loop) nothing else counts them, and only this keeps the
            // list from growing.
            self.expire_at(url, now);
            let id = self.next_room;
            self.next_room += 1;
            // Every room is kept equally long from now, so the newest ends last: appending keeps order.
            self.engine(url).rooms.push_back((id, until));
            self.by_last
                .entry(*h.last().unwrap_or(&0))
                .or_default()
                .push_back(id);
            let room = Room {
                url: url.to_owned(),
                endpoint: endpoint.clone_ref(py),
                key: h.into(),
                blocks,
                until,
            };
            self.open.insert(id, room);
            Ok(())
        })?
    }

    /// The endpoint whose room a follow-up ending in block hash ``last`` may take at ``now``, or None.
    /// The room is given up (the follow-up claims it); rooms found expired on the way close too.
    fn take(&mut self, py: Python<'_>, last: u64, now: f64) -> Option<Py<PyAny>> {
        while let Some(&id) = self.by_last.get(&last).and_then(|same| same.front()) {
            let room = &self.open[&id];
            let got = (room.until > now).then(|| room.endpoint.clone_ref(py));
            self.close(id);
            if got.is_some() {
                return got;
            }
        }
        None
    }

    /// Close the rooms kept on ``url`` whose window ended by ``now``.
    fn expire(&mut self, url: &str, now: f64) {
        self.expire_at(url, now)
    }

    /// Whether ``blocks`` more (a prompt of these hashes) fit on ``url``'s pool of ``kv_blocks`` (0:
    /// unknown, always): always when nothing of ours runs there; ``kept``: kept rooms count as taken.
    #[pyo3(signature = (url, kv_blocks, hashes, blocks, *, kept, now))]
    fn fits(
        &mut self,
        url: &str,
        kv_blocks: i64,
        hashes: &Bound<'_, PyAny>,
        blocks: i64,
        kept: bool,
        now: f64,
    ) -> PyResult<bool> {
        with_hashes(hashes, |h| {
            self.fits_now(url, kv_blocks, h, blocks, kept, now)
        })
    }

    /// The distinct blocks our requests running on ``url`` pin now.
    fn in_flight(&self, url: &str) -> i64 {
        self.engines.get(url).map_or(0, |e| e.running.distinct())
    }

    /// The distinct blocks of the open rooms kept on ``url`` (their shared prefixes counted once).
    fn reserved(&mut self, url: &str, now: f64) -> i64 {
        self.expire_at(url, now);
        let mut trie = Trie::default();
        for room in self.open.values().filter(|r| r.url == url) {
            trie.add(&room.key, room.blocks);
        }
        trie.distinct()
    }

    /// The most leading blocks a prompt of these hashes shares with one of our requests running on
    /// ``url`` (as the pass began, in a pass).
    fn longest_shared(&self, url: &str, hashes: &Bound<'_, PyAny>) -> PyResult<i64> {
        let running = self.running_at(url);
        with_hashes(hashes, |h| running.map_or(0, |t| t.longest_shared(h)))
    }

    /// Of ``blocks`` cached leading blocks of a prompt on ``url`` (a pool of ``kv_blocks``), how many
    /// stay until it can start there: those it shares with our requests running there, and as many
    /// more as the room they leave (router/admission.py, `Gate.surviving`, says why). All of them while
    /// nothing of ours runs there (as the pass began, in a pass).
    fn surviving(
        &self,
        url: &str,
        kv_blocks: i64,
        hashes: &Bound<'_, PyAny>,
        blocks: i64,
    ) -> PyResult<i64> {
        let Some(running) = self.running_at(url).filter(|t| !t.keys.is_empty()) else {
            return Ok(blocks);
        };
        let shared = with_hashes(hashes, |h| running.longest_shared(h))?;
        let room = (kv_blocks - 1 - running.distinct()).max(0);
        Ok(blocks.min(shared + room))
    }

    /// The earliest end of a room's window after ``now`` (infinite when none is kept).
    fn next_end(&self, now: f64) -> f64 {
        self.engines
            .values()
            .filter_map(|e| e.rooms.iter().map(|&(_, until)| until).find(|&u| u > now))
            .fold(f64::INFINITY, f64::min)
    }

    /// A gate pass begins: costs asked in it see each engine's running requests as it began.
    fn begin_pass(&mut self) {
        self.frozen = Some(FxHashMap::default());
    }

    fn end_pass(&mut self) {
        self.frozen = None;
    }

    /// Every open room: (url, its prompt's block hashes, blocks, until).
    fn open_rooms(&self) -> Vec<(String, Vec<u64>, i64, f64)> {
        let mut ids: Vec<&u64> = self.open.keys().collect();
        ids.sort();
        ids.into_iter()
            .map(|id| {
                let r = &self.open[id];
                (r.url.clone(), r.key.to_vec(), r.blocks, r.until)
            })
            .collect()
    }

    /// Rooms listed per engine (open, or closed and not yet expired) and open rooms indexed by their
    /// last block: what a window's churn must not pile up.
    fn listed(&self) -> (usize, usize) {
        let per_engine = self.engines.values().map(|e| e.rooms.len()).sum();
        let by_last = self.by_last.values().map(VecDeque::len).sum();
        (per_engine, by_last)
    }
}
