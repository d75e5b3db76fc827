//! Workloads that run on plain memory (`ptr`, `len`), so the same code measures uswap and the
//! kernel's own swap.

pub mod cpu;
pub mod distribution;
pub mod fault;
pub mod mem;
pub mod pattern;
pub mod probe;
pub mod random;
pub mod rng;
pub mod swapback;
