//! vLLM's chained block digests, byte for byte: ``sha256(serialize((parent, tuple(block_tokens), None)))``
//! with ``serialize`` = ``pickle.dumps(..., protocol=5)`` (``sha256``) or
//! ``cbor2.dumps(..., canonical=True)`` (``sha256_cbor``). router/hashing.py keeps the Python
//! definition; tests/unit/router/test_router_native.py checks these against it.
//!
//! In Python each block cost a serializer call and a hash, holding the GIL (~4 µs a block, 15 ms for a
//! 128K-token prompt): a prompt hashed in a background thread held up the event loop's requests.
//! Here the digests are computed with the GIL released.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use sha2::{Digest, Sha256};

/// pickle's frame target: a payload past it would be split into several frames (not done here).
const PICKLE_FRAME_TARGET: usize = 64 * 1024;

fn pickle_int(out: &mut Vec<u8>, v: i64) {
    if (0..=0xff).contains(&v) {
        out.extend_from_slice(&[b'K', v as u8]); // BININT1
    } else if (0..=0xffff).contains(&v) {
        out.push(b'M'); // BININT2
        out.extend_from_slice(&(v as u16).to_le_bytes());
    } else if (i32::MIN as i64..=i32::MAX as i64).contains(&v) {
        out.push(b'J'); // BININT
        out.extend_from_slice(&(v as i32).to_le_bytes());
    } else {
        // LONG1: the shortest little-endian two's complement.
        let bytes = v.to_le_bytes();
        let mut n = 8;
        while n > 1 {
            let (last, prev) = (bytes[n - 1], bytes[n - 2]);
            if (last == 0x00 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        out.extend_from_slice(&[0x8a, n as u8]);
        out.extend_from_slice(&bytes[..n]);
    }
}

/// ``pickle.dumps((parent, tuple(tokens), None), protocol=5)`` for a 32-byte parent.
fn pickle_block(out: &mut Vec<u8>, parent: &[u8; 32], tokens: &[i64]) {
    out.clear();
    out.extend_from_slice(&[0x80, 5, 0x95]); // PROTO 5, FRAME (length filled in below)
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(&[b'C', 32]); // SHORT_BINBYTES
    out.extend_from_slice(parent);
    out.push(0x94); // MEMOIZE
    match tokens.len() {
        0 => out.push(b')'), // EMPTY_TUPLE (not memoized)
        n @ 1..=3 => {
            for &t in tokens {
                pickle_int(out, t);
            }
            out.extend_from_slice(&[0x84 + n as u8, 0x94]); // TUPLE1..3, MEMOIZE
        }
        _ => {
            out.push(b'('); // MARK
            for &t in tokens {
                pickle_int(out, t);
            }
            out.extend_from_slice(&[b't', 0x94]); // TUPLE, MEMOIZE
        }
    }
    out.extend_from_slice(&[b'N', 0x87, 0x94, b'.']); // None, TUPLE3, MEMOIZE, STOP
    let frame = (out.len() - 11) as u64;
    out[3..11].copy_from_slice(&frame.to_le_bytes());
}

fn cbor_head(out: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        out.push(m | v as u8);
    } else if v <= 0xff {
        out.extend_from_slice(&[m | 24, v as u8]);
    } else if v <= 0xffff {
        out.push(m | 25);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        out.push(m | 26);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// ``cbor2.dumps((parent, tuple(tokens), None), canonical=True)`` for a 32-byte parent.
fn cbor_block(out: &mut Vec<u8>, parent: &[u8; 32], tokens: &[i64]) {
    out.clear();
    cbor_head(out, 4, 3); // array of 3
    cbor_head(out, 2, 32); // byte string
    out.extend_from_slice(parent);
    cbor_head(out, 4, tokens.len() as u64);
    for &t in tokens {
        if t >= 0 {
            cbor_head(out, 0, t as u64);
        } else {
            cbor_head(out, 1, (-1 - t) as u64);
        }
    }
    out.push(0xf6); // null
}

/// The chained digests of every full block of ``tokens`` (an ``array('q')``, read as a buffer, or any
/// sequence of ints): what router/hashing.py's ``block_digests`` returns, for ``algo`` ``sha256``
/// (pickle) or ``sha256_cbor``.
#[pyfunction]
pub fn block_digests<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    parent: &[u8],
    algo: &str,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let cbor = is_cbor(algo)?;
    let prev: [u8; 32] = parent
        .try_into()
        .map_err(|_| PyValueError::new_err("parent must be a 32-byte digest"))?;
    check_block_size(block_size, cbor)?;
    // Copied out while the GIL is held (an ``array('q')`` in one pass, a million tokens ~1 ms), so no
    // other thread can change them while they are hashed without it.
    let tokens: Vec<i64> = crate::with_ints(tokens, |t: &[i64]| t.to_vec())?;
    let digests = py.detach(|| chain(&tokens, block_size, prev, cbor));
    Ok(digests.iter().map(|d| PyBytes::new(py, d)).collect())
}

/// The chained digests of every full block of ``tokens`` after ``parent`` (the Rust side of
/// [`block_digests`], also used by the incremental encoder). ``block_size`` is checked by the callers.
pub(crate) fn chain(
    tokens: &[i64],
    block_size: usize,
    parent: [u8; 32],
    cbor: bool,
) -> Vec<[u8; 32]> {
    let mut prev = parent;
    let mut buf = Vec::with_capacity(64 + 9 * block_size);
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            if cbor {
                cbor_block(&mut buf, &prev, block);
            } else {
                pickle_block(&mut buf, &prev, block);
            }
            prev = Sha256::digest(&buf).into();
            prev
        })
        .collect()
}

/// The 64-bit value vLLM puts in KV events for a block digest (router/hashing.py's ``to_external``).
pub(crate) fn to_external(digest: &[u8; 32]) -> u64 {
    u64::from_be_bytes(digest[24..].try_into().expect("8 bytes"))
}

/// Whether ``algo`` is one this module reproduces, and which serializer it uses (``true``: CBOR).
pub(crate) fn is_cbor(algo: &str) -> PyResult<bool> {
    match algo {
        "sha256" => Ok(false),
        "sha256_cbor" => Ok(true),
        _ => Err(PyValueError::new_err(format!(
            "unsupported hash algorithm {algo:?}"
        ))),
    }
}

/// Whether one block of ``block_size`` tokens can be digested here (a pickled block stays in one frame).
pub(crate) fn check_block_size(block_size: usize, cbor: bool) -> PyResult<()> {
    if block_size == 0 || (!cbor && 16 + 9 * block_size >= PICKLE_FRAME_TARGET) {
        return Err(PyValueError::new_err(format!(
            "unsupported block size {block_size}"
        )));
    }
    Ok(())
}
