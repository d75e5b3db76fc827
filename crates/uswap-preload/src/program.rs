//! What uswap needs to know of the program it was loaded into, read from the program's own
//! headers in memory.

/// The note type of a Go build ID (`.note.go.buildid`, owner "Go").
const NT_GO_BUILD_ID: u32 = 4;

/// Whether the program was built by the Go toolchain (it carries a Go build ID note).
/// Go's runtime checks that its signal handlers run on the signal stacks it set up, which
/// SIGBUS mode's dispatch cannot give them.
pub fn is_go() -> bool {
    let mut found = false;
    // SAFETY: the callback reads the headers the dynamic linker hands it, and stops after
    // the first object, the program itself.
    unsafe { libc::dl_iterate_phdr(Some(first_object), (&mut found as *mut bool).cast()) };
    found
}

unsafe extern "C" fn first_object(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    found: *mut libc::c_void,
) -> libc::c_int {
    let info = &*info;
    let headers = std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum));
    *found.cast::<bool>() = headers
        .iter()
        .filter(|h| h.p_type == libc::PT_NOTE)
        .any(|h| {
            let start = (info.dlpi_addr + h.p_vaddr) as *const u8;
            has_go_note(std::slice::from_raw_parts(start, h.p_memsz as usize))
        });
    1 // the program comes first; the libraries do not matter
}

/// Whether the notes in `notes` (an ELF note segment) include a Go build ID.
fn has_go_note(mut notes: &[u8]) -> bool {
    let word = |b: &[u8], at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
    };
    while let (Some(name_len), Some(desc_len), Some(kind)) =
        (word(notes, 0), word(notes, 4), word(notes, 8))
    {
        let name_len = name_len as usize;
        let next = 12 + name_len.next_multiple_of(4) + (desc_len as usize).next_multiple_of(4);
        if notes.len() < next {
            return false;
        }
        // Go's linker writes the name padded: "Go\0\0".
        let name = &notes[12..12 + name_len];
        if kind == NT_GO_BUILD_ID && name.split(|&b| b == 0).next() == Some(b"Go") {
            return true;
        }
        notes = &notes[next..];
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(name: &[u8], kind: u32, desc: &[u8]) -> Vec<u8> {
        let mut n = Vec::new();
        n.extend((name.len() as u32).to_ne_bytes());
        n.extend((desc.len() as u32).to_ne_bytes());
        n.extend(kind.to_ne_bytes());
        n.extend(name);
        n.resize(n.len().next_multiple_of(4), 0);
        n.extend(desc);
        n.resize(n.len().next_multiple_of(4), 0);
        n
    }

    #[test]
    fn a_go_build_id_is_found_after_other_notes() {
        let mut notes = note(b"GNU\0", 3, &[7; 20]);
        assert!(!has_go_note(&notes));
        notes.extend(note(b"Go\0\0", NT_GO_BUILD_ID, b"abc/def"));
        assert!(has_go_note(&notes));
        assert!(
            !has_go_note(&note(b"Go\0\0", 1, b"x")),
            "another Go note type"
        );
        assert!(
            !has_go_note(&note(b"Gopher\0", NT_GO_BUILD_ID, b"x")),
            "another owner"
        );
        assert!(!has_go_note(&notes[..notes.len() - 9]), "a truncated note");
    }

    #[test]
    fn this_test_program_is_not_go() {
        assert!(!is_go());
    }
}
