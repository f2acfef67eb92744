//! router/followups.py's `FollowUps` in Rust: which prefix groups send their next request the moment
//! the last one ends. The Python class is the definition (its docstrings say why); this one keeps the
//! same three insertion-ordered maps and answers the same calls, without a Python object per ended
//! request or a Python loop over an arriving prompt's last 64 blocks. The parity test
//! (tests/unit/router/test_router_followups.py) replays random calls through both.

use hashlink::LinkedHashMap;
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::with_hashes;

// router/followups.py's _TAIL_BLOCKS and _KEEP.
const TAIL_BLOCKS: usize = 64;
const KEEP: usize = 4096;

struct Ended {
    endpoint: Py<PyString>,
    blocks: usize,
    group: u64,
    at: f64,
}

#[pyclass(module = "kvstrata_native", subclass)]
pub struct FollowUps {
    #[pyo3(get)]
    window_s: f64,
    #[pyo3(get)]
    only_evicted: bool,
    // Makes router/followups.py's FollowUp(last, endpoint, blocks, group) for an arrived follow-up.
    make: Py<PyAny>,
    ended: LinkedHashMap<u64, Ended>,
    rate: LinkedHashMap<u64, f64>,
    evicted: LinkedHashMap<u64, f64>,
}

/// Half weight on the newest observation (`FollowUps._learn`).
fn learn(rates: &mut LinkedHashMap<u64, f64>, group: u64, seen: bool) {
    let rate = rates.remove(&group).unwrap_or(0.0);
    rates.insert(group, 0.5 * rate + 0.5 * if seen { 1.0 } else { 0.0 });
    while rates.len() > KEEP {
        rates.pop_front();
    }
}

impl FollowUps {
    fn expire(&mut self, now: f64) {
        while let Some((_, e)) = self.ended.front() {
            if now - e.at <= self.window_s {
                break;
            }
            let group = e.group;
            self.ended.pop_front();
            learn(&mut self.rate, group, false);
        }
    }
}

#[pymethods]
impl FollowUps {
    #[new]
    #[pyo3(signature = (window_s, make, *, only_evicted=false))]
    fn new(window_s: f64, make: Py<PyAny>, only_evicted: bool) -> Self {
        Self {
            window_s,
            only_evicted,
            make,
            ended: LinkedHashMap::new(),
            rate: LinkedHashMap::new(),
            evicted: LinkedHashMap::new(),
        }
    }

    /// A request with these prompt block hashes ended well on ``endpoint`` at monotonic ``now``.
    fn ended(
        &mut self,
        hashes: &Bound<'_, PyAny>,
        endpoint: Py<PyString>,
        now: f64,
    ) -> PyResult<()> {
        let Some((first, last, n)) =
            with_hashes(hashes, |h| Some((*h.first()?, *h.last()?, h.len())))?
        else {
            return Ok(());
        };
        self.expire(now);
        // Inserting moves an existing key to the back, as OrderedDict.move_to_end does.
        self.ended.insert(
            last,
            Ended {
                endpoint,
                blocks: n,
                group: first,
                at: now,
            },
        );
        while self.ended.len() > KEEP {
            if let Some((_, e)) = self.ended.pop_front() {
                learn(&mut self.rate, e.group, false);
            }
        }
        Ok(())
    }

    /// A request arrives: the FollowUp of the request it extends when that one ended within the window
    /// (and the group learns that it was followed); else None.
    fn arrived(
        &mut self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        now: f64,
    ) -> PyResult<Option<Py<PyAny>>> {
        self.expire(now);
        if self.ended.is_empty() {
            return Ok(None);
        }
        let found = with_hashes(hashes, |h| {
            let from = h.len().saturating_sub(TAIL_BLOCKS);
            h[from..]
                .iter()
                .rev()
                .find_map(|last| self.ended.remove(last).map(|e| (*last, e)))
        })?;
        let Some((last, e)) = found else {
            return Ok(None);
        };
        learn(&mut self.rate, e.group, true);
        Ok(Some(
            self.make.call1(py, (last, e.endpoint, e.blocks, e.group))?,
        ))
    }

    /// A follow-up whose predecessor kept no room went to an engine while ``held_blocks`` of its prefix
    /// were still where that predecessor ended (``follow_up``: a FollowUp).
    fn found(&mut self, follow_up: &Bound<'_, PyAny>, held_blocks: usize) -> PyResult<()> {
        let blocks: usize = follow_up.getattr("blocks")?.extract()?;
        let group: u64 = follow_up.getattr("group")?.extract()?;
        learn(&mut self.evicted, group, held_blocks < blocks);
        Ok(())
    }

    /// Whether the group of a request that just ended usually sends its next one within the window
    /// (and, with ``only_evicted``, usually finds its blocks evicted by then).
    fn expected(&self, hashes: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Some(group) = with_hashes(hashes, |h| h.first().copied())? else {
            return Ok(false);
        };
        if self.rate.get(&group).copied().unwrap_or(0.0) < 0.5 {
            return Ok(false);
        }
        Ok(!self.only_evicted || self.evicted.get(&group).copied().unwrap_or(0.0) >= 0.5)
    }
}
