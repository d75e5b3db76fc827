//! The one intrusive list type: doubly linked lists threaded through an array of nodes by
//! index, so an element leaves the middle of a list in O(1) and the lists allocate nothing.
//! The swap allocator's cluster lists are made of these (the LRU lists, which need
//! SMP-safe operations, have atomic links of their own: `lru.rs`).

/// End-of-list marker.
pub(crate) const NIL: u32 = u32::MAX;

/// The links an element carries for the one list it may be on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    pub prev: u32,
    pub next: u32,
}

impl Link {
    pub const UNLINKED: Link = Link {
        prev: NIL,
        next: NIL,
    };
}

/// Access to the link of element `i` in whatever array holds the elements.
pub(crate) trait Links {
    fn link(&mut self, i: u32) -> &mut Link;
}

impl Links for [Link] {
    fn link(&mut self, i: u32) -> &mut Link {
        &mut self[i as usize]
    }
}

/// Head, tail and length of one list. The caller keeps track of which list (if any) an
/// element is on; these operations trust it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ListHead {
    pub head: u32,
    pub tail: u32,
    pub len: usize,
}

impl ListHead {
    pub const EMPTY: ListHead = ListHead {
        head: NIL,
        tail: NIL,
        len: 0,
    };

    pub fn push_back(&mut self, nodes: &mut (impl Links + ?Sized), i: u32) {
        *nodes.link(i) = Link {
            prev: self.tail,
            next: NIL,
        };
        match self.tail {
            NIL => self.head = i,
            t => nodes.link(t).next = i,
        }
        self.tail = i;
        self.len += 1;
    }

    /// Unlinks `i`, which must be on this list.
    pub fn remove(&mut self, nodes: &mut (impl Links + ?Sized), i: u32) {
        let Link { prev, next } = *nodes.link(i);
        match prev {
            NIL => self.head = next,
            p => nodes.link(p).next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => nodes.link(n).prev = prev,
        }
        *nodes.link(i) = Link::UNLINKED;
        self.len -= 1;
    }

    pub fn pop_front(&mut self, nodes: &mut (impl Links + ?Sized)) -> Option<u32> {
        let i = self.head;
        (i != NIL).then(|| {
            self.remove(nodes, i);
            i
        })
    }

    /// The elements from head to tail, after checking every back link, the tail and the
    /// length (the lists' invariant walker).
    #[cfg(test)]
    pub fn walk(&self, nodes: &mut (impl Links + ?Sized)) -> Result<Vec<u32>, String> {
        let mut out = Vec::with_capacity(self.len);
        let (mut i, mut prev) = (self.head, NIL);
        while i != NIL {
            let link = *nodes.link(i);
            if link.prev != prev {
                return Err(format!(
                    "element {i} links back to {} not {prev}",
                    link.prev
                ));
            }
            if out.len() > self.len {
                return Err(format!(
                    "more elements than the length {} (a cycle?)",
                    self.len
                ));
            }
            out.push(i);
            (prev, i) = (i, link.next);
        }
        if self.tail != prev || out.len() != self.len {
            return Err(format!(
                "tail {} / length {} but the walk ends at {prev} after {}",
                self.tail,
                self.len,
                out.len()
            ));
        }
        Ok(out)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn push_remove_and_pop_keep_order_and_length() {
        let mut nodes = [Link::UNLINKED; 6];
        let mut l = ListHead::EMPTY;
        for i in [1, 2, 3, 4] {
            l.push_back(&mut nodes[..], i);
        }
        assert_eq!(l.walk(&mut nodes[..]).unwrap(), vec![1, 2, 3, 4]);
        l.remove(&mut nodes[..], 3);
        assert_eq!(nodes[3], Link::UNLINKED);
        assert_eq!(l.walk(&mut nodes[..]).unwrap(), vec![1, 2, 4]);
        assert_eq!(l.pop_front(&mut nodes[..]), Some(1));
        l.remove(&mut nodes[..], 4);
        assert_eq!((l.head, l.tail, l.len), (2, 2, 1));
        assert_eq!(l.pop_front(&mut nodes[..]), Some(2));
        assert_eq!(l, ListHead::EMPTY);
        assert_eq!(l.pop_front(&mut nodes[..]), None);
    }
}
