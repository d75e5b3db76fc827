//! Which page an access picks: uniform (pmbench's default), Zipf, or a hot set.
//!
//! Real programs are skewed, and under skew the pages a replacement policy keeps decide
//! how many accesses miss. Skewed picks are ranks (0 the most popular), scattered over the
//! region by a fixed permutation, so popular pages are not neighbours: a policy gets no
//! help from readahead or from aging neighbours together.

use super::rng::Rng;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use rand_distr::Distribution as _;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How accesses are spread over the pages.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub enum Distribution {
    /// Every page alike.
    #[default]
    Uniform,
    /// Zipf with exponent `s`: the page of rank `k` is picked in proportion to `1/k^s`.
    Zipf { s: f64 },
    /// `pct` percent of accesses go to `of_pct` percent of the pages, the rest to the rest.
    Hot { pct: u8, of_pct: u8 },
}

impl FromStr for Distribution {
    type Err = String;

    /// `uniform`, `zipf:S` (S > 0, e.g. `zipf:0.99`) or `hot:P/Q` (P% of accesses to Q%
    /// of the pages, 0 < P, Q < 100).
    fn from_str(s: &str) -> Result<Distribution, String> {
        let bad = || {
            format!(
                "`{s}` is not a distribution: use uniform, zipf:S (an exponent S > 0, such as \
                 zipf:0.99) or hot:P/Q (P% of accesses to Q% of the pages, such as hot:90/10)"
            )
        };
        match s.split_once(':') {
            None if s == "uniform" => Ok(Distribution::Uniform),
            Some(("zipf", exp)) => match exp.parse::<f64>() {
                Ok(s) if s > 0.0 && s.is_finite() => Ok(Distribution::Zipf { s }),
                _ => Err(bad()),
            },
            Some(("hot", shares)) => {
                let (p, q) = shares.split_once('/').ok_or_else(bad)?;
                let share = |v: &str| v.parse::<u8>().ok().filter(|v| (1..100).contains(v));
                match (share(p), share(q)) {
                    (Some(pct), Some(of_pct)) => Ok(Distribution::Hot { pct, of_pct }),
                    _ => Err(bad()),
                }
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Distribution {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Distribution::Uniform => write!(f, "uniform"),
            Distribution::Zipf { s } => write!(f, "zipf:{s}"),
            Distribution::Hot { pct, of_pct } => write!(f, "hot:{pct}/{of_pct}"),
        }
    }
}

/// One accessing thread's page picker.
pub struct Picker {
    pages: u64,
    how: How,
    /// A stride coprime with `pages`: rank `k` is page `k * stride mod pages`.
    stride: u64,
}

enum How {
    Uniform,
    Zipf(rand_distr::Zipf<f64>, SmallRng),
    Hot { pct: u64, hot: u64 },
}

impl Picker {
    pub fn new(distribution: Distribution, pages: u64, seed: u64) -> Picker {
        assert!(pages > 0, "no pages to pick from");
        let how = match distribution {
            Distribution::Uniform => How::Uniform,
            Distribution::Zipf { s } => How::Zipf(
                rand_distr::Zipf::new(pages as f64, s).expect("a valid exponent and count"),
                SmallRng::seed_from_u64(seed),
            ),
            Distribution::Hot { pct, of_pct } => How::Hot {
                pct: pct.into(),
                hot: (pages * u64::from(of_pct) / 100).clamp(1, pages.saturating_sub(1).max(1)),
            },
        };
        Picker {
            pages,
            how,
            stride: coprime_stride(pages),
        }
    }

    /// The next page to access.
    pub fn pick(&mut self, rng: &mut Rng) -> u64 {
        let rank = match &mut self.how {
            How::Uniform => return rng.below(self.pages),
            How::Zipf(zipf, small) => (zipf.sample(small) as u64).clamp(1, self.pages) - 1,
            How::Hot { pct, hot } if rng.below(100) < *pct => rng.below(*hot),
            How::Hot { hot, .. } => *hot + rng.below(self.pages - *hot),
        };
        ((u128::from(rank) * u128::from(self.stride)) % u128::from(self.pages)) as u64
    }
}

/// A large odd stride with no factor in common with `pages`, so that multiplying by it
/// permutes `0..pages`.
fn coprime_stride(pages: u64) -> u64 {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut stride = (0x9e37_79b9_7f4a_7c15 % pages.max(2)) | 1;
    while gcd(stride, pages) != 1 {
        stride += 2;
    }
    stride
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_parse_and_print_back() {
        for text in ["uniform", "zipf:0.99", "zipf:1.2", "hot:90/10"] {
            let d: Distribution = text.parse().unwrap();
            assert_eq!(d.to_string(), text);
        }
        for bad in [
            "zipf",
            "zipf:0",
            "zipf:-1",
            "hot:90",
            "hot:0/10",
            "hot:90/100",
            "pareto:1",
        ] {
            let err = bad.parse::<Distribution>().unwrap_err();
            assert!(err.contains("uniform, zipf:S"), "{bad}: {err}");
        }
    }

    #[test]
    fn ranks_are_a_permutation_of_the_pages() {
        for pages in [1u64, 7, 64, 1000, 1 << 19] {
            let stride = coprime_stride(pages);
            let mut seen = vec![false; pages as usize];
            for rank in 0..pages {
                let page = (u128::from(rank) * u128::from(stride) % u128::from(pages)) as usize;
                assert!(!seen[page], "{pages} pages: page {page} twice");
                seen[page] = true;
            }
        }
    }

    /// Share of `n` picks that land on the `top` most picked pages.
    fn top_share(d: Distribution, pages: u64, top: usize, n: usize) -> f64 {
        let (mut picker, mut rng) = (Picker::new(d, pages, 3), Rng::new(3));
        let mut counts = vec![0u32; pages as usize];
        for _ in 0..n {
            let page = picker.pick(&mut rng);
            assert!(page < pages);
            counts[page as usize] += 1;
        }
        counts.sort_unstable_by(|a, b| b.cmp(a));
        counts[..top].iter().map(|&c| f64::from(c)).sum::<f64>() / n as f64
    }

    #[test]
    fn a_hot_set_gets_its_share_and_zipf_is_skewed() {
        let hot = top_share(
            Distribution::Hot {
                pct: 90,
                of_pct: 10,
            },
            1000,
            100,
            200_000,
        );
        assert!(
            (0.88..0.92).contains(&hot),
            "hot:90/10 gave the top 10% {hot}"
        );
        let zipf = top_share(Distribution::Zipf { s: 0.99 }, 10_000, 1000, 200_000);
        let uniform = top_share(Distribution::Uniform, 10_000, 1000, 200_000);
        // With s = 0.99 over 10,000 pages, the top 10% take about 75% of the picks.
        assert!(
            (0.7..0.8).contains(&zipf),
            "zipf:0.99 gave the top 10% {zipf}"
        );
        assert!(uniform < 0.2, "uniform gave the top 10% {uniform}");
    }
}
