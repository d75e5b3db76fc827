//! SIGBUS mode: the kernel sends the faulting thread SIGBUS instead of queueing an event,
//! and the thread resolves its own fault in the signal handler. No context switch, but a
//! kernel access to a missing page fails with EFAULT instead of being served.

use crate::error::{Error, Result};
use crate::fault::Outcome;
use crate::region::RegionCore;
use std::sync::atomic::{
    AtomicPtr,
    Ordering::{AcqRel, Acquire},
};
use std::sync::{Arc, Mutex, Once};

const MAX_REGIONS: usize = 64;

/// Regions in SIGBUS mode, looked up by the signal handler without locks or allocation.
static REGIONS: [AtomicPtr<RegionCore>; MAX_REGIONS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_REGIONS];

/// The SIGBUS action that was installed before ours, for signals that are not ours.
static PREVIOUS: Mutex<Option<libc::sigaction>> = Mutex::new(None);
static INSTALL: Once = Once::new();

pub(crate) fn register(core: &Arc<RegionCore>) -> Result<()> {
    install_handler()?;
    let ptr = Arc::as_ptr(core) as *mut RegionCore;
    for slot in &REGIONS {
        if slot
            .compare_exchange(std::ptr::null_mut(), ptr, AcqRel, Acquire)
            .is_ok()
        {
            return Ok(());
        }
    }
    Err(Error::invalid(
        "fault mode",
        format!("at most {MAX_REGIONS} regions can use SIGBUS mode at once; use thread mode"),
    ))
}

pub(crate) fn unregister(core: &RegionCore) {
    let ptr = core as *const RegionCore as *mut RegionCore;
    for slot in &REGIONS {
        let _ = slot.compare_exchange(ptr, std::ptr::null_mut(), AcqRel, Acquire);
    }
}

fn install_handler() -> Result<()> {
    let mut result = Ok(());
    INSTALL.call_once(|| {
        // SAFETY: sigaction structures are plain data; the handler is async-signal aware.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
            libc::sigemptyset(&mut act.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &act, &mut old) != 0 {
                result = Err(Error::os("sigaction(SIGBUS)"));
                return;
            }
            *PREVIOUS.lock().unwrap_or_else(|e| e.into_inner()) = Some(old);
        }
    });
    result
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in &REGIONS {
        let ptr = slot.load(Acquire);
        if ptr.is_null() {
            continue;
        }
        // SAFETY: a registered region outlives its registration (unregistered before drop).
        let core = unsafe { &*ptr };
        if let Some(page) = core.page_of(addr) {
            if let Outcome::Fatal = core.handle_fault(page, None) {
                restore_default();
            }
            return;
        }
    }
    forward(sig, info, ctx);
}

/// The access cannot be served: with the default action restored, the retried access
/// kills the process with SIGBUS.
fn restore_default() {
    // SAFETY: resetting a signal disposition.
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
}

/// Passes a SIGBUS that is not about a uswap region to whoever handled it before.
fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let previous = PREVIOUS.try_lock().ok().and_then(|g| *g);
    match previous {
        Some(old) if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN => {
            // SAFETY: calling the previously installed handler with the same arguments.
            unsafe {
                if old.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(old.sa_sigaction);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(old.sa_sigaction);
                    f(sig);
                }
            }
        }
        _ => restore_default(),
    }
}
