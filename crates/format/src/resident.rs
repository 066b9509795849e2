//! `model_weights.bin`: the resident index (24-byte header, 72-byte entries, string table,
//! padded to 16 KiB) followed by the resident tensors packed back to back
//! (`docs/FORMAT.md`, `model_weights.bin`).

use crate::{round_up_to_page, Dtype, FormatError};

/// Size of the index header `{indexSize u64, residentSize u64, entryCount u64}`, bytes.
pub const HEADER_BYTES: usize = 24;
/// Size of one index entry, bytes.
pub const ENTRY_BYTES: usize = 72;

/// One resident tensor. Offsets are absolute file offsets into `model_weights.bin`, sizes in
/// bytes. For an MLX affine-quantized tensor `dtype` is [`Dtype::U32`], the packed codes are
/// at `file_offset..+size_bytes`, BF16 scales at `scale_offset..+scale_size`, BF16 biases at
/// `bias_offset..+bias_size` (each `[rows, in/group]`); unquantized tensors have zero
/// scale/bias fields. `shape` is the logical (dequantized) shape, zero-padded to rank 4;
/// e.g. a 4-bit `q_proj` stored as U32 `[256, 32]` has shape `[256, 256, 0, 0]`.
/// Offsets may be only 2-byte aligned: readers must not assume more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// The source checkpoint tensor name, e.g. `language_model.model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    pub dtype: Dtype,
    pub file_offset: u64,
    pub size_bytes: u64,
    pub shape: [u32; 4],
    pub scale_offset: u64,
    pub scale_size: u64,
    pub bias_offset: u64,
    pub bias_size: u64,
}

impl IndexEntry {
    /// Whether the entry carries affine scales and biases (packed quantized weights).
    pub fn is_quantized(&self) -> bool {
        self.scale_size > 0
    }

    /// Logical shape without the zero padding.
    pub fn logical_shape(&self) -> Vec<u64> {
        self.shape
            .iter()
            .take_while(|&&d| d != 0)
            .map(|&d| d as u64)
            .collect()
    }

    /// The weight bytes inside the whole mapped file.
    pub fn weight_bytes<'a>(&self, file: &'a [u8]) -> &'a [u8] {
        &file[self.file_offset as usize..(self.file_offset + self.size_bytes) as usize]
    }

    /// The BF16 scale bytes inside the whole mapped file (empty when unquantized).
    pub fn scale_bytes<'a>(&self, file: &'a [u8]) -> &'a [u8] {
        &file[self.scale_offset as usize..(self.scale_offset + self.scale_size) as usize]
    }

    /// The BF16 bias bytes inside the whole mapped file (empty when unquantized).
    pub fn bias_bytes<'a>(&self, file: &'a [u8]) -> &'a [u8] {
        &file[self.bias_offset as usize..(self.bias_offset + self.bias_size) as usize]
    }
}

/// The parsed index of `model_weights.bin`. `index_size` (bytes) covers header, entries,
/// string table and padding to 16 KiB; tensors occupy `index_size..index_size+resident_size`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidentIndex {
    pub index_size: u64,
    pub resident_size: u64,
    pub entries: Vec<IndexEntry>,
    by_name: std::collections::HashMap<String, usize>,
}

fn bad(detail: impl Into<String>) -> FormatError {
    FormatError::ResidentIndexInvalid {
        detail: detail.into(),
    }
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

impl ResidentIndex {
    /// Build an index from entries (used by the installer); `resident_size` in bytes.
    pub fn new(index_size: u64, resident_size: u64, entries: Vec<IndexEntry>) -> Self {
        let by_name = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        ResidentIndex {
            index_size,
            resident_size,
            entries,
            by_name,
        }
    }

    /// Read only the 24-byte header: `(index_size, resident_size, entry_count)`.
    pub fn parse_header(first: &[u8]) -> Result<(u64, u64, u64), FormatError> {
        if first.len() < HEADER_BYTES {
            return Err(bad("file shorter than the 24-byte header"));
        }
        Ok((u64_at(first, 0), u64_at(first, 8), u64_at(first, 16)))
    }

    /// Parse the index from the bytes of the whole `model_weights.bin` (or at least its
    /// first `index_size` bytes when `check_tensors_in_bounds` is not needed; see
    /// [`ResidentIndex::parse_prefix`]). Checks every entry lies inside the tensor region.
    pub fn parse(file_bytes: &[u8]) -> Result<Self, FormatError> {
        let idx = Self::parse_prefix(file_bytes)?;
        let total = idx.index_size + idx.resident_size;
        if (file_bytes.len() as u64) < total {
            return Err(bad(format!(
                "file is {} bytes, header declares {total}",
                file_bytes.len()
            )));
        }
        Ok(idx)
    }

    /// Parse the index from the first `index_size` bytes of `model_weights.bin` without
    /// requiring the tensor region to be present in `bytes`.
    pub fn parse_prefix(bytes: &[u8]) -> Result<Self, FormatError> {
        let (index_size, resident_size, count) = Self::parse_header(bytes)?;
        if index_size % crate::FORMAT_PAGE_BYTES != 0 {
            return Err(bad(format!(
                "indexSize {index_size} is not a multiple of 16 KiB"
            )));
        }
        if (bytes.len() as u64) < index_size {
            return Err(bad(format!(
                "have {} bytes, indexSize is {index_size}",
                bytes.len()
            )));
        }
        let table_end = (HEADER_BYTES as u64)
            .checked_add(
                count
                    .checked_mul(ENTRY_BYTES as u64)
                    .ok_or_else(|| bad("entry count overflows"))?,
            )
            .ok_or_else(|| bad("entry table overflows"))?;
        if table_end > index_size {
            return Err(bad(format!(
                "{count} entries do not fit in indexSize {index_size}"
            )));
        }
        let region_end = index_size
            .checked_add(resident_size)
            .ok_or_else(|| bad("residentSize overflows"))?;
        let in_region = |what: &str, name: &str, off: u64, size: u64| -> Result<(), FormatError> {
            if size == 0 {
                return Ok(());
            }
            match off.checked_add(size) {
                Some(end) if off >= index_size && end <= region_end => Ok(()),
                _ => Err(bad(format!(
                    "{what} of {name} ({off}+{size}) is outside the tensor region {index_size}..{region_end}"
                ))),
            }
        };
        let mut entries = Vec::with_capacity(count as usize);
        for i in 0..count as usize {
            let e = &bytes[HEADER_BYTES + i * ENTRY_BYTES..HEADER_BYTES + (i + 1) * ENTRY_BYTES];
            let name_off = u32_at(e, 0) as u64;
            let name_len = u16::from_le_bytes([e[4], e[5]]) as u64;
            let dtype = Dtype::from_code(e[6])
                .ok_or_else(|| bad(format!("entry {i} has unknown dtype {}", e[6])))?;
            if name_off < table_end || name_off + name_len > index_size {
                return Err(bad(format!(
                    "entry {i} name range {name_off}+{name_len} is outside the string table"
                )));
            }
            let name =
                std::str::from_utf8(&bytes[name_off as usize..(name_off + name_len) as usize])
                    .map_err(|_| bad(format!("entry {i} name is not UTF-8")))?
                    .to_string();
            let shape = [u32_at(e, 24), u32_at(e, 28), u32_at(e, 32), u32_at(e, 36)];
            let entry = IndexEntry {
                name,
                dtype,
                file_offset: u64_at(e, 8),
                size_bytes: u64_at(e, 16),
                shape,
                scale_offset: u64_at(e, 40),
                scale_size: u64_at(e, 48),
                bias_offset: u64_at(e, 56),
                bias_size: u64_at(e, 64),
            };
            in_region("weights", &entry.name, entry.file_offset, entry.size_bytes)?;
            in_region("scales", &entry.name, entry.scale_offset, entry.scale_size)?;
            in_region("biases", &entry.name, entry.bias_offset, entry.bias_size)?;
            entries.push(entry);
        }
        let idx = Self::new(index_size, resident_size, entries);
        if idx.by_name.len() != idx.entries.len() {
            return Err(bad("duplicate tensor names"));
        }
        Ok(idx)
    }

    /// Look an entry up by its source checkpoint tensor name.
    pub fn get(&self, name: &str) -> Option<&IndexEntry> {
        self.by_name.get(name).map(|&i| &self.entries[i])
    }

    /// The `indexSize` for entries with these names: header + entries + string table,
    /// rounded up to 16 KiB.
    pub fn index_size_for<'a>(names: impl IntoIterator<Item = &'a str>) -> u64 {
        let mut n = 0u64;
        let mut strings = 0u64;
        for s in names {
            n += 1;
            strings += s.len() as u64;
        }
        round_up_to_page(HEADER_BYTES as u64 + n * ENTRY_BYTES as u64 + strings)
    }

    /// Encode the index region (exactly `index_size` bytes). Names are stored in entry
    /// order; `nameOffset` is an absolute file offset. Errors if a name is longer than
    /// 65,535 bytes or the region does not fit `index_size`.
    pub fn encode(&self) -> Result<Vec<u8>, FormatError> {
        let want = Self::index_size_for(self.entries.iter().map(|e| e.name.as_str()));
        if want != self.index_size {
            return Err(bad(format!(
                "indexSize {} does not match the entries ({want})",
                self.index_size
            )));
        }
        let mut out = vec![0u8; self.index_size as usize];
        out[0..8].copy_from_slice(&self.index_size.to_le_bytes());
        out[8..16].copy_from_slice(&self.resident_size.to_le_bytes());
        out[16..24].copy_from_slice(&(self.entries.len() as u64).to_le_bytes());
        let mut name_cursor = HEADER_BYTES + self.entries.len() * ENTRY_BYTES;
        for (i, e) in self.entries.iter().enumerate() {
            let len = u16::try_from(e.name.len())
                .map_err(|_| bad(format!("name of {} is too long", e.name)))?;
            let name_off =
                u32::try_from(name_cursor).map_err(|_| bad("string table beyond 4 GiB"))?;
            let b = &mut out[HEADER_BYTES + i * ENTRY_BYTES..HEADER_BYTES + (i + 1) * ENTRY_BYTES];
            b[0..4].copy_from_slice(&name_off.to_le_bytes());
            b[4..6].copy_from_slice(&len.to_le_bytes());
            b[6] = e.dtype.code();
            b[7] = 0;
            b[8..16].copy_from_slice(&e.file_offset.to_le_bytes());
            b[16..24].copy_from_slice(&e.size_bytes.to_le_bytes());
            for (k, d) in e.shape.iter().enumerate() {
                b[24 + 4 * k..28 + 4 * k].copy_from_slice(&d.to_le_bytes());
            }
            b[40..48].copy_from_slice(&e.scale_offset.to_le_bytes());
            b[48..56].copy_from_slice(&e.scale_size.to_le_bytes());
            b[56..64].copy_from_slice(&e.bias_offset.to_le_bytes());
            b[64..72].copy_from_slice(&e.bias_size.to_le_bytes());
            out[name_cursor..name_cursor + e.name.len()].copy_from_slice(e.name.as_bytes());
            name_cursor += e.name.len();
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, off: u64, size: u64) -> IndexEntry {
        IndexEntry {
            name: name.into(),
            dtype: Dtype::BF16,
            file_offset: off,
            size_bytes: size,
            shape: [size as u32 / 2, 0, 0, 0],
            scale_offset: 0,
            scale_size: 0,
            bias_offset: 0,
            bias_size: 0,
        }
    }

    #[test]
    fn header_and_entry_bytes_follow_the_documented_layout() {
        let p = 16_384;
        let idx = ResidentIndex::new(p, 10, vec![entry("ab", p, 4), entry("xyz", p + 4, 6)]);
        let bytes = idx.encode().unwrap();
        assert_eq!(bytes.len(), 16_384);
        // Header fields, little-endian.
        assert_eq!(&bytes[0..8], &16_384u64.to_le_bytes());
        assert_eq!(&bytes[8..16], &10u64.to_le_bytes());
        assert_eq!(&bytes[16..24], &2u64.to_le_bytes());
        // First entry: name at absolute offset 24 + 2*72 = 168, len 2, dtype 1.
        assert_eq!(&bytes[24..28], &168u32.to_le_bytes());
        assert_eq!(&bytes[28..30], &2u16.to_le_bytes());
        assert_eq!(bytes[30], 1);
        assert_eq!(&bytes[168..173], b"abxyz");
        let mut file = bytes.clone();
        file.extend_from_slice(&[0u8; 10]);
        let back = ResidentIndex::parse(&file).unwrap();
        assert_eq!(back, idx);
        assert_eq!(back.get("xyz").unwrap().file_offset, p + 4);
    }

    #[test]
    fn entry_outside_the_tensor_region_is_rejected() {
        let p = 16_384;
        let idx = ResidentIndex::new(p, 4, vec![entry("a", p, 8)]);
        let mut file = idx.encode().unwrap();
        file.extend_from_slice(&[0u8; 8]);
        assert!(matches!(
            ResidentIndex::parse(&file),
            Err(FormatError::ResidentIndexInvalid { .. })
        ));
    }
}
