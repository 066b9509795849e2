//! A contiguous, 2 MiB-aligned anonymous memory region holding the expert slots of one layer.

use crate::RuntimeError;

/// Alignment of the slab start: one x86-64 huge page, so the kernel can back it with THP.
pub const SLAB_ALIGN: usize = 2 << 20;

/// Anonymous mapping of `len` bytes whose start is aligned to [`SLAB_ALIGN`].
///
/// The mapping is over-allocated by one alignment unit and the usable window starts at the first
/// aligned address inside it; page alignment is what O_DIRECT reads into the slab require.
pub struct Slab {
    map: memmap2::MmapMut,
    start: usize,
    len: usize,
}

impl Slab {
    /// Maps `len` bytes (zero-filled, lazily committed by the kernel).
    ///
    /// Errors: [`RuntimeError::Slab`] when the mapping fails.
    pub fn new(len: usize) -> Result<Self, RuntimeError> {
        let total = len + SLAB_ALIGN;
        let map = memmap2::MmapMut::map_anon(total).map_err(|source| RuntimeError::Slab {
            bytes: total,
            source,
        })?;
        let addr = map.as_ptr() as usize;
        let start = addr.next_multiple_of(SLAB_ALIGN) - addr;
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(Self { map, start, len })
    }

    /// The usable bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// Raw pointer to the usable window, for concurrent reads into disjoint slots.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: `start + len <= total` by construction.
        unsafe { self.map.as_mut_ptr().add(self.start) }
    }

    /// Usable length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the slab holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
