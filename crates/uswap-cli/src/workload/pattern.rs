//! The verifiable content of every page.
//!
//! Word 0 is a header `(page << 32) | version`; the version counts the writes to the page.
//! Every other word `i` holds `mix(page, i)`, written once at setup and never again, so any
//! page that comes back from swap wrong, misplaced or stale shows up on the next read.

use super::mem::WORDS;
use super::rng::splitmix64;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

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
pub fn fill(words: &[AtomicU64], page: u64) {
    words[0].store(header(page, 0), Relaxed);
    for (i, w) in words.iter().enumerate().skip(1) {
        w.store(mix(page, i), Relaxed);
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

pub fn check_word(page: u64, word: usize, found: u64) -> Result<(), Mismatch> {
    let expected = mix(page, word);
    if found == expected {
        Ok(())
    } else {
        Err(Mismatch {
            page,
            word,
            expected,
            found,
        })
    }
}

/// Checks a whole page whose final version is known; returns every wrong word.
pub fn check_page(words: &[AtomicU64], page: u64, version: u32) -> Vec<Mismatch> {
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
        if let Err(m) = check_word(page, i, w.load(Relaxed)) {
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
        fill(&words, 77);
        assert!(check_page(&words, 77, 0).is_empty());
        assert!(check_header(77, words[0].load(Relaxed), 0).is_ok());
    }

    #[test]
    fn wrong_page_stale_version_and_zeros_are_caught() {
        let words = page();
        fill(&words, 5);
        // Another page's content.
        assert_eq!(check_page(&words, 6, 0).len(), WORDS);
        // A header older than a recorded write.
        assert!(check_header(5, header(5, 2), 3).is_err());
        assert!(check_header(5, header(5, 3), 3).is_ok());
        // A page that came back as zeros.
        let zeros = page();
        assert_eq!(check_page(&zeros, 5, 0).len(), WORDS);
    }

    #[test]
    fn one_flipped_word_is_reported_precisely() {
        let words = page();
        fill(&words, 9);
        words[100].fetch_xor(1, Relaxed);
        let bad = check_page(&words, 9, 0);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].word, 100);
        assert_eq!(bad[0].found ^ bad[0].expected, 1);
    }
}
