//! uswap's half of the kernel's `mmap_changing` (fs/userfaultfd.c). The kernel refuses
//! fills (EAGAIN) from the moment a non-cooperative event (madvise, mremap, munmap) is
//! queued until a reader has read it, and then carries the change out: the zap of
//! `MADV_DONTNEED` runs after the read, in the program's thread. A page uswap filled
//! between that read and its own handling of the event could land after the kernel's zap
//! and survive it, stale. So uswap fences fills from just before every read of the
//! userfaultfd until the events it read are handled, and never zaps behind the kernel
//! (two zaps of one range at once can livelock in `UFFDIO_MOVE` on Linux 6.18).
//!
//! - Every fill of region memory (UFFDIO_COPY, UFFDIO_MOVE in or out, UFFDIO_POISON)
//!   passes the gate: it counts itself in flight, then looks at the fence.
//! - The reader raises the fence ([`Fence::Reading`]), waits until no fill is in flight,
//!   reads, and lowers the fence at once when it read only faults; with an event it holds
//!   the fence ([`Fence::Events`]) until the events are handled.
//! - A fill that meets `Reading` waits (a read is one system call); one that meets `Events`
//!   backs out with EAGAIN, like the kernel's own refusal: the event handler may need the
//!   page lock the fill holds. Its fault is retried after the event.
//!
//! The fill's count and the reader's fence are a Dekker pair (SeqCst on both sides):
//! either the fill sees the fence, or the reader sees the fill and waits for it. One
//! thread reads at a time (the handler leader, or the SIGBUS service thread).

use crate::sync::{backoff, AtomicU32};
use std::sync::atomic::Ordering::{Relaxed, Release, SeqCst};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u32)]
enum Fence {
    Down = 0,
    Reading = 1,
    Events = 2,
}

#[derive(Default)]
pub(crate) struct MmapChanging {
    fence: AtomicU32,
    fills: AtomicU32,
}

/// A fill in flight; it leaves the gate when dropped.
pub(crate) struct FillPass<'a>(&'a MmapChanging);

impl Drop for FillPass<'_> {
    fn drop(&mut self) {
        self.0.fills.fetch_sub(1, Release);
    }
}

/// The fence raised by the reader; lowered when dropped.
pub(crate) struct Raised<'a>(&'a MmapChanging);

impl Raised<'_> {
    /// The read returned an event: fills back out until this guard is dropped.
    pub fn hold_for_events(&self) {
        self.0.fence.store(Fence::Events as u32, SeqCst);
    }
}

impl Drop for Raised<'_> {
    fn drop(&mut self) {
        self.0.fence.store(Fence::Down as u32, SeqCst);
    }
}

impl MmapChanging {
    /// Lets a fill through, or `None` while events are being handled (back out).
    pub fn enter_fill(&self) -> Option<FillPass<'_>> {
        let mut round = 0;
        loop {
            self.fills.fetch_add(1, SeqCst);
            let fence = self.fence.load(SeqCst);
            if fence == Fence::Down as u32 {
                return Some(FillPass(self));
            }
            self.fills.fetch_sub(1, SeqCst);
            if fence == Fence::Events as u32 {
                return None;
            }
            while self.fence.load(Relaxed) == Fence::Reading as u32 {
                backoff(round);
                round += 1;
            }
        }
    }

    /// Raises the fence and waits for the fills in flight; the caller then reads.
    pub fn raise(&self) -> Raised<'_> {
        debug_assert_eq!(
            self.fence.load(Relaxed),
            Fence::Down as u32,
            "one reader at a time"
        );
        self.fence.store(Fence::Reading as u32, SeqCst);
        let mut round = 0;
        // A read-modify-write, not a load: it reads the latest count, and a fill that comes
        // after it in the count's order synchronizes with it and so sees the fence.
        while self.fills.fetch_add(0, SeqCst) != 0 {
            backoff(round.min(127));
            round += 1;
        }
        Raised(self)
    }

    /// Whether events are being handled (fills back out until they are).
    pub fn events_held(&self) -> bool {
        self.fence.load(SeqCst) == Fence::Events as u32
    }

    /// Whether events are read or being handled: page states may be about to change.
    pub fn changing(&self) -> bool {
        self.fence.load(SeqCst) != Fence::Down as u32
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::Arc;

    /// No fill is ever inside the gate while the reader reads or handles events, and a fill
    /// that is refused was refused while events were held.
    #[test]
    fn no_fill_overlaps_a_read_or_an_event() {
        loom::model(|| {
            let gate = Arc::new(MmapChanging::default());
            let inside = Arc::new(AtomicBool::new(false));
            let filler = {
                let (gate, inside) = (gate.clone(), inside.clone());
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        if let Some(_pass) = gate.enter_fill() {
                            inside.store(true, SeqCst);
                            inside.store(false, SeqCst);
                        }
                    }
                })
            };
            {
                let raised = gate.raise();
                assert!(!inside.load(SeqCst), "a fill ran during the read");
                raised.hold_for_events();
                assert!(!inside.load(SeqCst), "a fill ran during event handling");
            }
            filler.join().unwrap();
            assert!(!gate.changing());
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;

    #[test]
    fn fills_back_out_only_while_events_are_held() {
        let gate = MmapChanging::default();
        assert!(gate.enter_fill().is_some());
        let raised = gate.raise();
        assert!(gate.changing());
        raised.hold_for_events();
        assert!(gate.enter_fill().is_none());
        drop(raised);
        assert!(!gate.changing());
        assert!(gate.enter_fill().is_some());
    }

    /// Four fillers against a reader raising the fence over and over: no fill is ever
    /// inside while the fence is up, and fills still get through between reads.
    #[test]
    fn stress_fills_against_reads() {
        let gate = Arc::new(MmapChanging::default());
        let inside = Arc::new(AtomicU32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let ran = Arc::new(AtomicU64::new(0));
        let fillers: Vec<_> = (0..4)
            .map(|_| {
                let (gate, inside, stop) = (gate.clone(), inside.clone(), stop.clone());
                let ran = ran.clone();
                std::thread::spawn(move || {
                    while !stop.load(Relaxed) {
                        if let Some(_pass) = gate.enter_fill() {
                            inside.fetch_add(1, SeqCst);
                            std::hint::spin_loop();
                            inside.fetch_sub(1, SeqCst);
                            ran.fetch_add(1, Relaxed);
                        }
                    }
                })
            })
            .collect();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        for i in 0.. {
            if i >= 20_000 && ran.load(Relaxed) >= 1_000 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "fills starved");
            // Leave the fence down a moment, as a handler does between reads.
            (0..200).for_each(|_| std::hint::spin_loop());
            let raised = gate.raise();
            assert_eq!(inside.load(SeqCst), 0, "a fill overlapped a read");
            if i % 2 == 0 {
                raised.hold_for_events();
                assert_eq!(inside.load(SeqCst), 0, "a fill overlapped an event");
            }
        }
        stop.store(true, Relaxed);
        for f in fillers {
            f.join().unwrap();
        }
    }
}
