//! Sealed slots: with swap encryption on (the default), every page is encrypted and
//! authenticated on its way to the swap device, as the kernel's swap on dm-crypt with a
//! random key does, and OpenBSD's swap by default. The AEAD is AES-256-GCM where the CPU
//! has AES instructions and ChaCha20-Poly1305 elsewhere, from `ring` (its assembly runs
//! AES-GCM at 6.8 GB/s a core here, RustCrypto's `aes-gcm` at 1.3). Its key is drawn at
//! random when the device is made, lives only in this process's memory (a page of its own,
//! locked there where the process may lock memory, left out of core dumps, and overwritten
//! when the device is dropped), and is never written: once the process is gone, what it
//! left on the disk cannot be read.
//!
//! A write's nonce is its slot and a generation the device never hands out twice, so no
//! nonce repeats under a key; the slot is also the associated data. A slot's ciphertext
//! copied to another slot, or an older ciphertext of the same slot, fails its tag, and a
//! failed tag is a checksum mismatch: read again, then poisoned, never returned.

use crate::sud::raw_syscall;
use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use zeroize::Zeroize;

/// A slot's seal: the generation of its last write (never 0) and the tag of that write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sealed {
    pub generation: u64,
    pub tag: [u8; 16],
}

/// A device's key.
pub struct Seal {
    key: KeyPage,
    next_generation: AtomicU64,
}

/// The expanded key in a page of its own, mapped straight from the kernel (under `uswap
/// run` the C library's `mmap` is the program's, served from its region): locked against
/// swapping (best effort: a process over its `RLIMIT_MEMLOCK` keeps it unlocked), left out
/// of core dumps (`MADV_DONTDUMP`), and overwritten with zeros before it is unmapped.
struct KeyPage(*mut LessSafeKey);

// SAFETY: the page is owned by the `KeyPage` alone; `LessSafeKey` is Send and Sync.
unsafe impl Send for KeyPage {}
unsafe impl Sync for KeyPage {}

impl KeyPage {
    fn new(key: LessSafeKey) -> std::io::Result<KeyPage> {
        const { assert!(std::mem::size_of::<LessSafeKey>() <= crate::PAGE_SIZE) };
        let (len, rw) = (
            crate::PAGE_SIZE as u64,
            (libc::PROT_READ | libc::PROT_WRITE) as u64,
        );
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        let at = raw_syscall(libc::SYS_mmap, [0, len, rw, flags, u64::MAX, 0]);
        if at < 0 {
            return Err(std::io::Error::from_raw_os_error(-at as i32));
        }
        let dontdump = libc::MADV_DONTDUMP as u64;
        raw_syscall(libc::SYS_madvise, [at as u64, len, dontdump, 0, 0, 0]);
        raw_syscall(libc::SYS_mlock, [at as u64, len, 0, 0, 0, 0]);
        let page = at as *mut LessSafeKey;
        // SAFETY: a fresh, page-aligned, writable page, large enough (asserted above).
        unsafe { page.write(key) };
        Ok(KeyPage(page))
    }

    fn key(&self) -> &LessSafeKey {
        // SAFETY: written in `new`, valid until drop.
        unsafe { &*self.0 }
    }

    /// Where the key lives (for the test that looks at the page's flags).
    #[cfg(test)]
    fn address(&self) -> usize {
        self.0 as usize
    }
}

impl Drop for KeyPage {
    fn drop(&mut self) {
        // SAFETY: the key is plain data (no destructor, nothing it owns), never used again;
        // the page is overwritten in place and then unmapped.
        unsafe {
            std::slice::from_raw_parts_mut(self.0.cast::<u8>(), crate::PAGE_SIZE).zeroize();
        }
        raw_syscall(
            libc::SYS_munmap,
            [self.0 as u64, crate::PAGE_SIZE as u64, 0, 0, 0, 0],
        );
    }
}

impl Seal {
    /// A seal with a fresh random key; the cipher the CPU runs fastest.
    pub fn new() -> std::io::Result<Seal> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)?;
        let algorithm = match aes_instructions() {
            true => &AES_256_GCM,
            false => &CHACHA20_POLY1305,
        };
        let unbound = UnboundKey::new(algorithm, &bytes).expect("a 32-byte key");
        bytes.zeroize();
        Ok(Seal {
            key: KeyPage::new(LessSafeKey::new(unbound))?,
            next_generation: AtomicU64::new(1),
        })
    }

    /// The cipher's name, for reports.
    pub fn cipher(&self) -> &'static str {
        match self.key.key().algorithm() == &AES_256_GCM {
            true => "AES-256-GCM",
            false => "ChaCha20-Poly1305",
        }
    }

    /// Encrypts `page`, about to be written to `slot`, in place.
    pub fn seal(&self, slot: u32, page: &mut [u8]) -> Sealed {
        let generation = self.next_generation.fetch_add(1, Relaxed);
        let nonce = Nonce::assume_unique_for_key(nonce(slot, generation));
        let tag = self
            .key
            .key()
            .seal_in_place_separate_tag(nonce, Aad::from(slot.to_le_bytes()), page)
            .expect("a page is far below the AEAD's length limit");
        let mut sealed = Sealed {
            generation,
            tag: [0; 16],
        };
        sealed.tag.copy_from_slice(tag.as_ref());
        sealed
    }

    /// Decrypts `page`, read from `slot`, in place: true when its tag matches `sealed`.
    /// On false the page holds nothing usable. Allocates nothing (the SIGBUS handler
    /// calls it).
    pub fn open(&self, slot: u32, sealed: Sealed, page: &mut [u8]) -> bool {
        let nonce = Nonce::assume_unique_for_key(nonce(slot, sealed.generation));
        let aad = Aad::from(slot.to_le_bytes());
        self.key
            .key()
            .open_in_place_separate_tag(nonce, aad, Tag::from(sealed.tag), page, 0..)
            .is_ok()
    }
}

/// The cipher this CPU seals with, and how fast one core seals and opens pages with it, in
/// bytes per second, over `pages` pages each way.
pub fn speed(pages: usize) -> std::io::Result<(&'static str, f64, f64)> {
    let seal = Seal::new()?;
    let mut page = vec![0x5au8; crate::PAGE_SIZE];
    let start = std::time::Instant::now();
    for slot in 0..pages as u32 {
        std::hint::black_box(seal.seal(slot, &mut page));
    }
    let sealing = start.elapsed().as_secs_f64();
    let sealed = seal.seal(7, &mut page);
    let mut scratch = page.clone();
    let start = std::time::Instant::now();
    for _ in 0..pages {
        // A valid ciphertext each time: a failed tag would skip the decryption.
        scratch.copy_from_slice(&page);
        assert!(seal.open(7, sealed, &mut scratch));
    }
    let opening = start.elapsed().as_secs_f64();
    let bytes = (pages * crate::PAGE_SIZE) as f64;
    Ok((
        seal.cipher(),
        bytes / sealing.max(1e-9),
        bytes / opening.max(1e-9),
    ))
}

fn nonce(slot: u32, generation: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[..4].copy_from_slice(&slot.to_le_bytes());
    n[4..].copy_from_slice(&generation.to_le_bytes());
    n
}

/// Whether AES-GCM runs on dedicated instructions here (AES and carry-less multiply).
fn aes_instructions() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
            && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marked_page() -> Vec<u8> {
        (0..4096).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn a_sealed_page_opens_only_in_its_slot_with_its_generation_and_key() {
        let seal = Seal::new().unwrap();
        let plain = marked_page();
        let mut page = plain.clone();
        let sealed = seal.seal(7, &mut page);
        assert_ne!(page, plain, "sealed in place");
        let ciphertext = page.clone();

        assert!(seal.open(7, sealed, &mut page));
        assert_eq!(page, plain);

        // Replayed into another slot.
        let mut moved = ciphertext.clone();
        assert!(!seal.open(8, sealed, &mut moved));
        // An older write of the same slot.
        let newer = seal.seal(7, &mut marked_page());
        let mut old = ciphertext.clone();
        assert!(!seal.open(7, newer, &mut old));
        // One bit flipped.
        let mut flipped = ciphertext.clone();
        flipped[1234] ^= 0x10;
        assert!(!seal.open(7, sealed, &mut flipped));
        // Another device's key.
        let mut other = ciphertext;
        assert!(!Seal::new().unwrap().open(7, sealed, &mut other));
    }

    /// The key's page is locked and left out of core dumps (`lo` and `dd` in its
    /// VmFlags).
    #[test]
    fn the_key_lives_on_a_locked_page_left_out_of_core_dumps() {
        let seal = Seal::new().unwrap();
        let at = seal.key.address();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let flags = smaps
            .lines()
            .find_map(|line| {
                if let Some((range, _)) = line.split_once(' ') {
                    if let Some((lo, hi)) = range.split_once('-') {
                        if let (Ok(lo), Ok(hi)) =
                            (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                        {
                            inside = (lo..hi).contains(&at);
                        }
                    }
                }
                line.strip_prefix("VmFlags:").filter(|_| inside)
            })
            .expect("the key's mapping in smaps");
        let flags: Vec<&str> = flags.split_whitespace().collect();
        assert!(flags.contains(&"dd"), "{flags:?}");
        // Locked where the process may lock memory (root, or a memlock limit above a page).
        let may_lock = unsafe { libc::geteuid() } == 0;
        assert!(!may_lock || flags.contains(&"lo"), "{flags:?}");
    }

    #[test]
    fn generations_never_repeat() {
        let seal = Seal::new().unwrap();
        let a = seal.seal(1, &mut marked_page());
        let b = seal.seal(1, &mut marked_page());
        assert!(a.generation != 0 && b.generation > a.generation);
        assert_ne!(a.tag, b.tag);
    }
}
