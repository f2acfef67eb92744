//! The byte-level pre-tokenizers' splits for ASCII text, without the `tokenizers` pipeline's objects:
//! GPT-2's (`ByteLevel` with its regex) and Llama 3's and Qwen2's (`Split` on their regex, then
//! `ByteLevel` without one).
//!
//! The incremental encoder tokenizes a prompt's new tail on every request: a few dozen characters. There
//! the pipeline's fixed cost dominates: its Oniguruma pass of the split regex, the normalized and
//! pre-tokenized strings with their alignments, and an `Encoding` with every token's string and offsets
//! (about 11 µs for 23 characters in the Python package, 6.5 of them the pre-tokenizer). For ASCII text
//! with no added token in it, the regex's split is a few comparisons per byte, so this module splits
//! it by hand and asks the tokenizer's own BPE model (and its cache) for each word's ids. Anything else
//! (other characters, an added token, a normalizer, another pre-tokenizer or pattern, dropout,
//! truncation or padding) goes through the pipeline as before: [`FastByteLevel::of`] and
//! [`FastByteLevel::ids`] say None. The router's start-up self-check and
//! `tests/unit/router/test_router_bytelevel.py` compare both with the Python package.

use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::split::SplitPattern;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{Model, SplitDelimiterBehavior, Tokenizer};

// router/incremental.py's LLAMA3_PATTERN and QWEN2_PATTERN: a `Split` on exactly one of these is split
// by hand; any other pattern goes through the pipeline.
const LLAMA3_PATTERN: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN2_PATTERN: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// Which regex splits the text.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pattern {
    Gpt2,
    /// Llama 3's (`digits` 3: `\p{N}{1,3}`) or Qwen2's (1: `\p{N}`).
    Llama3 {
        digits: usize,
    },
}

/// The pipeline's shortcut for one tokenizer (see the module doc).
pub struct FastByteLevel {
    pattern: Pattern,
    prefix_space: bool,
    chars: [char; 256],
}

/// GPT-2's bytes-to-unicode table (`tokenizers`' `bytes_char`): printable bytes map to themselves, the
/// others to 256 and up in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        out[b as usize] = if printable(b) {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("256..=511 are chars")
        };
    }
    out
}

/// The regex's `\s` on ASCII (Unicode White_Space: tab to carriage return, and space).
fn is_space(b: u8) -> bool {
    matches!(b, b'\t'..=b'\r' | b' ')
}

/// The regex's classes on ASCII: letter (`\p{L}`), digit (`\p{N}`), or neither and not `\s`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Other,
    Space,
}

fn class(b: u8) -> Class {
    if b.is_ascii_alphabetic() {
        Class::Letter
    } else if b.is_ascii_digit() {
        Class::Digit
    } else if is_space(b) {
        Class::Space
    } else {
        Class::Other
    }
}

/// The end of the run of class `c` that starts at `from`.
fn run_end(t: &[u8], from: usize, c: Class) -> usize {
    from + t[from..].iter().take_while(|&&b| class(b) == c).count()
}

/// The length of a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) starting at `t[0]`, a
/// quote; 0 if none. `fold`: in either case (Llama 3's and Qwen2's `(?i:...)`), else lower case only.
fn contraction(t: &[u8], fold: bool) -> usize {
    let at = |k: usize| {
        t.get(k)
            .map(|&b| if fold { b.to_ascii_lowercase() } else { b })
    };
    match (at(1), at(2)) {
        (Some(b'r'), Some(b'e')) | (Some(b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => 3,
        (Some(b's' | b't' | b'm' | b'd'), _) => 2,
        _ => 0,
    }
}

/// Calls `word` with each match of `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
/// over ASCII `t`, in order: the alternatives are tried left to right at each position, as the
/// backtracking engine does, and together the matches cover `t`.
pub fn split_gpt2(t: &[u8], mut word: impl FnMut(&[u8])) {
    let n = t.len();
    let mut i = 0;
    while i < n {
        let b = t[i];
        let quoted = if b == b'\'' {
            contraction(&t[i..], false)
        } else {
            0
        };
        if quoted > 0 {
            word(&t[i..i + quoted]);
            i += quoted;
            continue;
        }
        // ` ?X+` for the three classes: an optional space, then a run of one class.
        let j = if b == b' ' { i + 1 } else { i };
        if j < n {
            let c = class(t[j]);
            if c != Class::Space {
                let end = run_end(t, j, c);
                word(&t[i..end]);
                i = end;
                continue;
            }
        }
        let take = spaces_end(t, i);
        word(&t[i..take]);
        i = take;
    }
}

/// Where `\s+(?!\S)|\s+` ends from `i`, a space: the run but for its last space when a non-space
/// follows it (`\s+(?!\S)`), or a single space followed by a non-space (`\s+`).
fn spaces_end(t: &[u8], i: usize) -> usize {
    let end = i + t[i..].iter().take_while(|&&b| is_space(b)).count();
    if end == t.len() || end - i == 1 {
        end
    } else {
        end - 1
    }
}

/// Calls `word` with each match of Llama 3's pattern over ASCII `t` (Qwen2's with `digits` 1), as
/// [`split_gpt2`] does GPT-2's: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
/// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
pub fn split_llama3(t: &[u8], digits: usize, mut word: impl FnMut(&[u8])) {
    let n = t.len();
    let newline = |b: u8| b == b'\r' || b == b'\n';
    let mut i = 0;
    while i < n {
        let b = t[i];
        let quoted = if b == b'\'' {
            contraction(&t[i..], true)
        } else {
            0
        };
        if quoted > 0 {
            word(&t[i..i + quoted]);
            i += quoted;
            continue;
        }
        let c = class(b);
        // `[^\r\n\p{L}\p{N}]?\p{L}+`: letters, after at most one character that is neither a newline,
        // a letter nor a digit.
        if c == Class::Letter {
            let end = run_end(t, i, Class::Letter);
            word(&t[i..end]);
            i = end;
            continue;
        }
        if c != Class::Digit && !newline(b) && i + 1 < n && class(t[i + 1]) == Class::Letter {
            let end = run_end(t, i + 1, Class::Letter);
            word(&t[i..end]);
            i = end;
            continue;
        }
        // `\p{N}{1,digits}`.
        if c == Class::Digit {
            let end = run_end(t, i, Class::Digit).min(i + digits);
            word(&t[i..end]);
            i = end;
            continue;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`.
        let j = if b == b' ' { i + 1 } else { i };
        if j < n && class(t[j]) == Class::Other {
            let mut end = run_end(t, j, Class::Other);
            end += t[end..].iter().take_while(|&&b| newline(b)).count();
            word(&t[i..end]);
            i = end;
            continue;
        }
        // Whitespace from here on (`c` is Space). `\s*[\r\n]+`: up to the run's last newline.
        let end = run_end(t, i, Class::Space);
        if let Some(last) = t[i..end].iter().rposition(|&b| newline(b)) {
            word(&t[i..i + last + 1]);
            i += last + 1;
            continue;
        }
        let take = spaces_end(t, i);
        word(&t[i..take]);
        i = take;
    }
}

/// The pattern of a `Split` pre-tokenizer that this module splits by hand.
fn known_split(pattern: &SplitPattern) -> Option<Pattern> {
    match pattern {
        SplitPattern::Regex(p) if p == LLAMA3_PATTERN => Some(Pattern::Llama3 { digits: 3 }),
        SplitPattern::Regex(p) if p == QWEN2_PATTERN => Some(Pattern::Llama3 { digits: 1 }),
        _ => None,
    }
}

impl FastByteLevel {
    /// The shortcut for `tok`, or None when its pipeline does more than a known byte-level split and a
    /// BPE model.
    pub fn of(tok: &Tokenizer) -> Option<Self> {
        let (pattern, prefix_space) = match tok.get_pre_tokenizer()? {
            PreTokenizerWrapper::ByteLevel(bl) if bl.use_regex => {
                (Pattern::Gpt2, bl.add_prefix_space)
            }
            PreTokenizerWrapper::Sequence(seq) => match seq.as_ref() {
                [PreTokenizerWrapper::Split(split), PreTokenizerWrapper::ByteLevel(bl)]
                    if !bl.use_regex
                        && !bl.add_prefix_space
                        && !split.invert
                        && split.behavior == SplitDelimiterBehavior::Isolated =>
                {
                    (known_split(&split.pattern)?, false)
                }
                _ => return None,
            },
            _ => return None,
        };
        let ModelWrapper::BPE(bpe) = tok.get_model() else {
            return None;
        };
        let plain = tok.get_normalizer().is_none()
            && tok.get_truncation().is_none()
            && tok.get_padding().is_none()
            && bpe.dropout.is_none();
        plain.then(|| FastByteLevel {
            pattern,
            prefix_space,
            chars: byte_chars(),
        })
    }

    /// The ids the pipeline gives `text` without special tokens, or None when `text` is not one this
    /// shortcut knows (empty, not ASCII: the caller also leaves out text with an added token in it).
    pub fn ids(&self, model: &ModelWrapper, text: &str) -> Option<tokenizers::Result<Vec<u32>>> {
        if text.is_empty() || !text.is_ascii() {
            return None;
        }
        let mut t = text.as_bytes();
        let spaced: Vec<u8>;
        if self.prefix_space && t[0] != b' ' {
            spaced = [b" ", t].concat();
            t = &spaced;
        }
        let mut ids = Vec::with_capacity(t.len() / 3 + 1);
        let mut mapped = String::new();
        let mut failed = None;
        let each = |w: &[u8]| {
            if failed.is_some() {
                return;
            }
            mapped.clear();
            mapped.extend(w.iter().map(|&b| self.chars[b as usize]));
            match model.tokenize(&mapped) {
                Ok(tokens) => ids.extend(tokens.iter().map(|tk| tk.id)),
                Err(e) => failed = Some(e),
            }
        };
        match self.pattern {
            Pattern::Gpt2 => split_gpt2(t, each),
            Pattern::Llama3 { digits } => split_llama3(t, digits, each),
        }
        Some(match failed {
            None => Ok(ids),
            Some(e) => Err(e),
        })
    }
}
