//! The switch of syscall user dispatch (the kernel's `PR_SET_SYSCALL_USER_DISPATCH`): the
//! address range the kernel always lets through, the per-thread selector byte it reads at
//! each system call, and the routines in that range. Everything uswap's own code needs to
//! make a system call that is never dispatched lives here, at the bottom of the layers; the
//! SIGSYS handler that serves a dispatched call is `syscall_dispatch.rs`, above SIGBUS mode.
//!
//! The range holds four small routines: a six-argument system call ([`raw_syscall`]), the
//! program's own call run on its stack with its mask ([`program_call`]), the signal return
//! uswap's handlers return through ([`sigreturn_address`]), and `clone` for a new thread
//! ([`clone_with_registers`]).

use std::arch::global_asm;
use std::cell::UnsafeCell;

const PR_SET_SYSCALL_USER_DISPATCH: libc::c_int = 59;
const PR_SYS_DISPATCH_ON: libc::c_ulong = 1;
const PR_SYS_DISPATCH_OFF: libc::c_ulong = 0;
/// Selector values: the thread's system calls go to the kernel, or are dispatched.
pub(crate) const ALLOW: u8 = 0;
pub(crate) const BLOCK: u8 = 1;
/// `sa_flags` bit: `restorer` is the signal return.
pub(crate) const SA_RESTORER: u64 = 0x0400_0000;

global_asm!(
    ".pushsection .text.uswap_sud,\"ax\",@progbits",
    ".p2align 4",
    ".globl uswap_sud_begin",
    ".hidden uswap_sud_begin",
    "uswap_sud_begin:",
    // i64 uswap_sud_syscall6(nr, a0, a1, a2, a3, a4, a5)
    ".globl uswap_sud_syscall6",
    ".hidden uswap_sud_syscall6",
    "uswap_sud_syscall6:",
    // Unwind information: a direct call (`syscall_direct.rs`) cancelled in its system
    // call unwinds through here.
    ".cfi_startproc",
    "mov rax, rdi",
    "mov rdi, rsi",
    "mov rsi, rdx",
    "mov rdx, rcx",
    "mov r10, r8",
    "mov r8, r9",
    "mov r9, [rsp + 8]",
    "syscall",
    "ret",
    ".cfi_endproc",
    // i64 uswap_sud_call(const u64 call[7], u64 sp, const u64 masks[2],
    //                    const stack_t stacks[2])
    // The program's call (nr, a0..a5) with the program's signal mask (masks[0]; masks[1]
    // after), run on the program's stack `sp` (0: where the handler runs), so that a
    // program handler it lets in runs where it would have. The alternate stack is first
    // narrowed to what lies below the handler's frame (stacks[0]; stacks[1] after), so
    // that nested handlers do not overwrite that frame; if the kernel refuses, the call
    // runs where the handler does.
    ".globl uswap_sud_call",
    ".hidden uswap_sud_call",
    "uswap_sud_call:",
    "push rbx",
    "push rbp",
    "push r12",
    "push r13",
    "push r14",
    "push r15",
    "mov rbx, rdi",
    "mov r12, rdx",
    "mov r13, rcx",
    "mov r14, rsp",
    "test rsi, rsi",
    "jz 3f",
    "mov rsp, rsi",
    "mov eax, 131",
    "mov rdi, r13",
    "xor esi, esi",
    "syscall",
    "test rax, rax",
    "jz 3f",
    "mov rsp, r14",
    "3:",
    "mov eax, 14",
    "mov edi, 2",
    "mov rsi, r12",
    "xor edx, edx",
    "mov r10d, 8",
    "syscall",
    "mov rax, [rbx]",
    "mov rdi, [rbx + 8]",
    "mov rsi, [rbx + 16]",
    "mov rdx, [rbx + 24]",
    "mov r10, [rbx + 32]",
    "mov r8, [rbx + 40]",
    "mov r9, [rbx + 48]",
    "syscall",
    "mov r15, rax",
    "mov eax, 14",
    "mov edi, 2",
    "lea rsi, [r12 + 8]",
    "xor edx, edx",
    "mov r10d, 8",
    "syscall",
    "cmp rsp, r14",
    "je 4f",
    "mov eax, 131",
    "lea rdi, [r13 + 24]",
    "xor esi, esi",
    "syscall",
    "mov rsp, r14",
    "4:",
    "mov rax, r15",
    "pop r15",
    "pop r14",
    "pop r13",
    "pop r12",
    "pop rbp",
    "pop rbx",
    "ret",
    // The restorer of uswap's signal handlers.
    ".globl uswap_sud_sigreturn",
    ".hidden uswap_sud_sigreturn",
    "uswap_sud_sigreturn:",
    "mov eax, 15",
    "syscall",
    "ud2",
    // i64 uswap_sud_clone(const u64 regs[13]): rax, rdi, rsi, rdx, r10, r8, r9, rbx, rbp,
    // r12..r15 loaded from `regs`, then the system call. The parent returns here; the
    // child's stack holds the program's rdi and next instruction, which it pops.
    ".globl uswap_sud_clone",
    ".hidden uswap_sud_clone",
    "uswap_sud_clone:",
    "push rbx",
    "push rbp",
    "push r12",
    "push r13",
    "push r14",
    "push r15",
    "mov rax, [rdi]",
    "mov rsi, [rdi + 16]",
    "mov rdx, [rdi + 24]",
    "mov r10, [rdi + 32]",
    "mov r8, [rdi + 40]",
    "mov r9, [rdi + 48]",
    "mov rbx, [rdi + 56]",
    "mov rbp, [rdi + 64]",
    "mov r12, [rdi + 72]",
    "mov r13, [rdi + 80]",
    "mov r14, [rdi + 88]",
    "mov r15, [rdi + 96]",
    "mov rdi, [rdi + 8]",
    "syscall",
    "test rax, rax",
    "jz 2f",
    "pop r15",
    "pop r14",
    "pop r13",
    "pop r12",
    "pop rbp",
    "pop rbx",
    "ret",
    // The child: a CLONE_VFORK child keeps the parent's alternate signal stack, where the
    // parent's handler frame is live; it gives it up before any signal can use it.
    "2:",
    "push rsi",
    "mov eax, 131",
    "lea rdi, [rip + uswap_sud_no_altstack]",
    "xor esi, esi",
    "syscall",
    "pop rsi",
    "xor eax, eax",
    "pop rdi",
    "ret",
    ".p2align 3",
    "uswap_sud_no_altstack:",
    ".quad 0",
    ".long 2",
    ".long 0",
    ".quad 0",
    ".globl uswap_sud_end",
    ".hidden uswap_sud_end",
    "uswap_sud_end:",
    ".popsection",
);

extern "C-unwind" {
    // Unwinds when a direct call is cancelled in it (its frame has unwind information).
    fn uswap_sud_syscall6(nr: i64, a0: u64, a1: u64, a2: u64, a3: u64, a4: u64, a5: u64) -> i64;
}

extern "C" {
    fn uswap_sud_sigreturn();
    fn uswap_sud_clone(regs: *const u64) -> i64;
    fn uswap_sud_call(
        call: *const u64,
        sp: u64,
        masks: *const u64,
        stacks: *const libc::stack_t,
    ) -> i64;
    static uswap_sud_begin: u8;
    static uswap_sud_end: u8;
}

/// A system call that dispatch lets through (from inside the range).
pub(crate) fn raw_syscall(nr: i64, a: [u64; 6]) -> i64 {
    // SAFETY: a system call with the caller's arguments, as `syscall(2)` would make it.
    unsafe { uswap_sud_syscall6(nr, a[0], a[1], a[2], a[3], a[4], a[5]) }
}

thread_local! {
    /// The byte the kernel reads at each of this thread's system calls.
    static SELECTOR: UnsafeCell<u8> = const { UnsafeCell::new(ALLOW) };
}

/// Sets this thread's selector, returning the old value.
pub(crate) fn set_selector(value: u8) -> u8 {
    SELECTOR.with(|s| {
        // SAFETY: the thread's own byte, read by the kernel only at this thread's calls.
        unsafe {
            let old = std::ptr::read_volatile(s.get());
            std::ptr::write_volatile(s.get(), value);
            old
        }
    })
}

/// Whether this thread runs with dispatch and is in the program's code (not in one of
/// uswap's handlers): its system calls from outside the range are dispatched.
pub(crate) fn dispatching_program_code() -> bool {
    // SAFETY: the thread's own byte.
    SELECTOR.with(|s| unsafe { std::ptr::read_volatile(s.get()) } == BLOCK)
}

thread_local! {
    /// uswap's signal handlers (SIGBUS, SIGSYS) running on this thread, nested.
    static IN_HANDLER: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether one of uswap's signal handlers is running on this thread: its system calls
/// are uswap's own, and must not be cancellation points (a cancellation pending for an
/// asynchronously cancelable thread would act inside the handler, whose frames cannot be
/// unwound).
pub(crate) fn in_uswap_handler() -> bool {
    // The selector says *block* while a handler runs the program's own call, during which
    // the program's handlers may run.
    IN_HANDLER.get() > 0 && !dispatching_program_code()
}

/// While alive, this thread's system calls go straight to the kernel: uswap's signal
/// handlers run inside one.
pub(crate) struct Allowed(u8);

impl Allowed {
    pub fn new() -> Allowed {
        IN_HANDLER.set(IN_HANDLER.get() + 1);
        Allowed(set_selector(ALLOW))
    }
}

impl Drop for Allowed {
    fn drop(&mut self) {
        set_selector(self.0);
        IN_HANDLER.set(IN_HANDLER.get() - 1);
    }
}

/// The kernel's `struct sigaction` for `rt_sigaction`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct KernelSigaction {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

/// Turns dispatch on for the calling thread with the range of uswap's routines and the
/// thread's selector, set to *allow* (nothing is dispatched until it says *block*).
pub(crate) fn turn_on_with_selector_at_allow() -> std::result::Result<(), std::io::Error> {
    let begin = std::ptr::addr_of!(uswap_sud_begin) as u64;
    let end = std::ptr::addr_of!(uswap_sud_end) as u64;
    let selector = SELECTOR.with(|s| s.get() as u64);
    set_selector(ALLOW);
    // SAFETY: prctl with the range of our routines and this thread's selector, which
    // lives as long as the thread.
    let rc = unsafe {
        libc::prctl(
            PR_SET_SYSCALL_USER_DISPATCH,
            PR_SYS_DISPATCH_ON,
            begin,
            end - begin,
            selector,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Whether this kernel offers syscall user dispatch to this process: tried once, in a
/// thread of its own that turns it on with its selector at *allow* (so nothing is
/// dispatched, and no handler is needed) and ends. Changes nothing else in the process.
pub fn supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("uswap-probe".into())
            .spawn(|| {
                let on = turn_on_with_selector_at_allow().is_ok();
                disable_for_this_thread();
                on
            })
            .is_ok_and(|probe| probe.join().unwrap_or(false))
    })
}

/// Whether the kernel gives the calling thread syscall user dispatch, found by turning it
/// on with the selector at *allow*, which dispatches nothing: for a thread that goes on to
/// turn it on for good, without [`supported`]'s probe thread. Where it is refused, nothing
/// changed.
pub fn supported_here() -> bool {
    turn_on_with_selector_at_allow().is_ok()
}

/// Turns dispatch off for the calling thread.
pub fn disable_for_this_thread() {
    set_selector(ALLOW);
    // SAFETY: prctl turning this thread's dispatch off.
    unsafe { libc::prctl(PR_SET_SYSCALL_USER_DISPATCH, PR_SYS_DISPATCH_OFF, 0, 0, 0) };
}

/// The signal return uswap's handlers return through, inside the range.
pub(crate) fn sigreturn_address() -> u64 {
    uswap_sud_sigreturn as *const () as u64
}

/// Runs the program's call `call` (nr, a0..a5) on the program's stack `sp` (0: where the
/// caller runs), with the program's mask `masks[0]` (`masks[1]` after) and the alternate
/// stack narrowed to `stacks[0]` (`stacks[1]` after); see the routine above.
///
/// # Safety
/// As the system call itself; `sp`, when not 0, must be a usable stack of the calling
/// thread, and the selector must say *block* only while the program's own call runs.
pub(crate) unsafe fn program_call(
    call: &[u64; 7],
    sp: u64,
    masks: &[u64; 2],
    stacks: &[libc::stack_t; 2],
) -> i64 {
    uswap_sud_call(call.as_ptr(), sp, masks.as_ptr(), stacks.as_ptr())
}

/// `clone` with the thirteen registers `regs` loaded (rax, rdi, rsi, rdx, r10, r8, r9,
/// rbx, rbp, r12..r15); the child returns to what its new stack holds.
///
/// # Safety
/// As the system call itself: the child's stack must hold its return frame.
pub(crate) unsafe fn clone_with_registers(regs: &[u64; 13]) -> i64 {
    uswap_sud_clone(regs.as_ptr())
}
