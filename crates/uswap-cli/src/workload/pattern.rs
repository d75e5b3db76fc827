//! The verifiable content of every page.
//!
//! Word 0 is a header `(page << 32) | version`; the version counts the writes to the page.
//! Every other word `i` holds [`word`]`(data, page, i)`, written once at setup and never
//! again, so any page that comes back from swap wrong, misplaced or stale shows up on the
//! next read. What those words are ([`Data`]) sets how well the pages compress.

use super::mem::WORDS;
use super::rng::splitmix64;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What the words after a page's header hold.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum Data {
    /// Random words: no compressor shrinks them.
    #[default]
    Random,
    /// Words drawn from 64 eight-byte English words: text-like, about 2-3:1 with LZ4.
    Text,
    /// The first 1/R of the words random, the rest one word: compresses about R:1.
    Compressible(u8),
    /// P% of the pages zero after their header (which the check needs), the rest random.
    Zeros(u8),
}

impl FromStr for Data {
    type Err = String;

    /// `random`, `text`, `compressible:R` (R from 2 to 64) or `zeros:P` (P from 1 to 100).
    fn from_str(s: &str) -> Result<Data, String> {
        let bad = || {
            format!(
                "`{s}` is not a page content: use random, text, compressible:R (about R:1, R \
                 from 2 to 64) or zeros:P (P% of the pages zero, P from 1 to 100)"
            )
        };
        match s.split_once(':') {
            None if s == "random" => Ok(Data::Random),
            None if s == "text" => Ok(Data::Text),
            Some(("compressible", r)) => match r.parse::<u8>() {
                Ok(r @ 2..=64) => Ok(Data::Compressible(r)),
                _ => Err(bad()),
            },
            Some(("zeros", p)) => match p.parse::<u8>() {
                Ok(p @ 1..=100) => Ok(Data::Zeros(p)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Data {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Data::Random => f.write_str("random"),
            Data::Text => f.write_str("text"),
            Data::Compressible(r) => write!(f, "compressible:{r}"),
            Data::Zeros(p) => write!(f, "zeros:{p}"),
        }
    }
}

/// The words of [`Data::Text`].
const TOKENS: [&[u8; 8]; 64] = [
    b"the     ",
    b"of      ",
    b"and     ",
    b"to      ",
    b"in      ",
    b"is      ",
    b"that    ",
    b"for     ",
    b"it      ",
    b"as      ",
    b"was     ",
    b"with    ",
    b"be      ",
    b"by      ",
    b"on      ",
    b"not     ",
    b"he      ",
    b"this    ",
    b"are     ",
    b"or      ",
    b"his     ",
    b"from    ",
    b"at      ",
    b"which   ",
    b"but     ",
    b"have    ",
    b"an      ",
    b"had     ",
    b"they    ",
    b"you     ",
    b"were    ",
    b"their   ",
    b"one     ",
    b"all     ",
    b"we      ",
    b"can     ",
    b"her     ",
    b"has     ",
    b"there   ",
    b"been    ",
    b"if      ",
    b"more    ",
    b"when    ",
    b"will    ",
    b"would   ",
    b"who     ",
    b"so      ",
    b"no      ",
    b"memory  ",
    b"page    ",
    b"swap    ",
    b"kernel  ",
    b"process ",
    b"thread  ",
    b"fault   ",
    b"limit   ",
    b"reclaim ",
    b"slot    ",
    b"cluster ",
    b"cache   ",
    b"device  ",
    b"user    ",
    b"space   ",
    b"file.\n  ",
];

/// Word `i` (not the header) of page `page` holding `data`.
pub fn word(data: Data, page: u64, i: usize) -> u64 {
    match data {
        Data::Random => mix(page, i),
        Data::Text => u64::from_le_bytes(*TOKENS[(mix(page, i) % 64) as usize]),
        Data::Compressible(r) if i >= WORDS / r as usize => 0x5bd1_e995_0000_0000 | page,
        Data::Compressible(_) => mix(page, i),
        Data::Zeros(p) if mix(page, 0) % 100 < p as u64 => 0,
        Data::Zeros(_) => mix(page, i),
    }
}

/// Verify errors printed in detail; the rest are only counted.
const ERRORS_SHOWN: u64 = 5;

pub fn mix(page: u64, word: usize) -> u64 {
    splitmix64((page << 12) | word as u64)
}

pub fn header(page: u64, version: u32) -> u64 {
    (page << 32) | version as u64
}

pub fn header_page(h: u64) -> u64 {
    h >> 32
}

pub fn header_version(h: u64) -> u32 {
    h as u32
}

/// Writes page `page`'s pattern with version 0.
pub fn fill(words: &[AtomicU64], page: u64, data: Data) {
    words[0].store(header(page, 0), Relaxed);
    for (i, w) in words.iter().enumerate().skip(1) {
        w.store(word(data, page, i), Relaxed);
    }
}

/// One wrong word, for the error report.
#[derive(Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub page: u64,
    pub word: usize,
    pub expected: u64,
    pub found: u64,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "page {} word {}: expected {:#018x}, found {:#018x}",
            self.page, self.word, self.expected, self.found
        )
    }
}

/// Checks a header against the page it was read from and the lowest version it may have.
pub fn check_header(page: u64, found: u64, min_version: u32) -> Result<(), Mismatch> {
    if header_page(found) == page && header_version(found) >= min_version {
        Ok(())
    } else {
        Err(Mismatch {
            page,
            word: 0,
            expected: header(page, min_version),
            found,
        })
    }
}

pub fn check_word(data: Data, page: u64, i: usize, found: u64) -> Result<(), Mismatch> {
    let expected = word(data, page, i);
    if found == expected {
        Ok(())
    } else {
        Err(Mismatch {
            page,
            word: i,
            expected,
            found,
        })
    }
}

/// Checks a whole page whose final version is known; returns every wrong word.
pub fn check_page(words: &[AtomicU64], page: u64, version: u32, data: Data) -> Vec<Mismatch> {
    let mut bad = Vec::new();
    let h = words[0].load(Relaxed);
    if h != header(page, version) {
        bad.push(Mismatch {
            page,
            word: 0,
            expected: header(page, version),
            found: h,
        });
    }
    for (i, w) in words.iter().enumerate().take(WORDS).skip(1) {
        if let Err(m) = check_word(data, page, i, w.load(Relaxed)) {
            bad.push(m);
        }
    }
    bad
}

/// Counts verify errors and prints the first few in detail (on stderr, so `--json` output
/// stays clean).
pub struct ErrorLog {
    what: &'static str,
    count: AtomicU64,
}

impl ErrorLog {
    pub fn new(what: &'static str) -> Self {
        ErrorLog {
            what,
            count: AtomicU64::new(0),
        }
    }

    pub fn check(&self, result: Result<(), Mismatch>) {
        if let Err(m) = result {
            self.report(&m, 1);
        }
    }

    pub fn report(&self, m: &Mismatch, wrong_words: usize) {
        if self.count.fetch_add(1, Relaxed) < ERRORS_SHOWN {
            eprintln!(
                "verify error ({}): {m} ({wrong_words} wrong words)",
                self.what
            );
        }
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page() -> Vec<AtomicU64> {
        (0..WORDS).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn a_filled_page_checks_clean() {
        let words = page();
        fill(&words, 77, Data::Random);
        assert!(check_page(&words, 77, 0, Data::Random).is_empty());
        assert!(check_header(77, words[0].load(Relaxed), 0).is_ok());
    }

    #[test]
    fn wrong_page_stale_version_and_zeros_are_caught() {
        let words = page();
        fill(&words, 5, Data::Random);
        // Another page's content.
        assert_eq!(check_page(&words, 6, 0, Data::Random).len(), WORDS);
        // A header older than a recorded write.
        assert!(check_header(5, header(5, 2), 3).is_err());
        assert!(check_header(5, header(5, 3), 3).is_ok());
        // A page that came back as zeros.
        let zeros = page();
        assert_eq!(check_page(&zeros, 5, 0, Data::Random).len(), WORDS);
    }

    #[test]
    fn one_flipped_word_is_reported_precisely() {
        let words = page();
        fill(&words, 9, Data::Random);
        words[100].fetch_xor(1, Relaxed);
        let bad = check_page(&words, 9, 0, Data::Random);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].word, 100);
        assert_eq!(bad[0].found ^ bad[0].expected, 1);
    }

    /// The page's bytes, as a compressor sees them.
    fn bytes(data: Data, page: u64) -> Vec<u8> {
        let words = page_of(data, page);
        words
            .iter()
            .flat_map(|w| w.load(Relaxed).to_le_bytes())
            .collect()
    }

    fn page_of(data: Data, page: u64) -> Vec<AtomicU64> {
        let words = (0..WORDS).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        fill(&words, page, data);
        words
    }

    #[test]
    fn every_kind_of_content_checks_clean_and_catches_a_wrong_word() {
        for data in [
            Data::Random,
            Data::Text,
            Data::Compressible(3),
            Data::Zeros(50),
        ] {
            for page in 0..50 {
                let words = page_of(data, page);
                assert!(
                    check_page(&words, page, 0, data).is_empty(),
                    "{data} page {page}"
                );
                words[300].fetch_xor(1 << 7, Relaxed);
                assert_eq!(
                    check_page(&words, page, 0, data).len(),
                    1,
                    "{data} page {page}"
                );
            }
        }
    }

    #[test]
    fn contents_compress_as_their_names_say() {
        let ratio = |data: Data| {
            let (raw, packed) = (0..200u64).fold((0, 0), |(raw, packed), page| {
                let b = bytes(data, page);
                (raw + b.len(), packed + lz4_flex::block::compress(&b).len())
            });
            raw as f64 / packed as f64
        };
        assert!(ratio(Data::Random) < 1.01, "random {}", ratio(Data::Random));
        let three = ratio(Data::Compressible(3));
        assert!((2.6..3.4).contains(&three), "compressible:3 {three}");
        let text = ratio(Data::Text);
        assert!((1.5..5.0).contains(&text), "text {text}");
        let zeros = ratio(Data::Zeros(50));
        assert!((1.8..2.3).contains(&zeros), "zeros:50 {zeros}");
    }

    #[test]
    fn contents_parse_and_print_and_bad_ones_are_refused() {
        for text in ["random", "text", "compressible:3", "zeros:40"] {
            assert_eq!(text.parse::<Data>().unwrap().to_string(), text);
        }
        for bad in [
            "compressible:1",
            "compressible:65",
            "zeros:0",
            "zeros:101",
            "gzip",
            "",
        ] {
            let e = bad.parse::<Data>().unwrap_err();
            assert!(e.contains("compressible:R"), "{e}");
        }
    }
}
