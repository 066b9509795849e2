//! Recorded expert routing (`assets/traces/*.npy`): the top-k expert ids a trained MoE chose at
//! every token and layer, replayed as the router's decision in benchmarks and cache simulations so
//! that they see routing with real skew and temporal locality instead of a random router's
//! near-uniform picks (`assets/traces/README.md` has the provenance).

use std::path::Path;

use crate::RuntimeError;

/// A routing trace: `ids[token][layer][k]`, NumPy uint8 `[tokens, layers, top_k]`.
#[derive(Clone, Debug)]
pub struct RoutingTrace {
    ids: Vec<u8>,
    pub tokens: usize,
    pub layers: usize,
    pub top_k: usize,
}

impl RoutingTrace {
    /// Reads a C-order uint8 `.npy` of rank 3 (format versions 1-3).
    ///
    /// Errors: [`RuntimeError::Trace`] naming the file and what is wrong (not an .npy, another
    /// dtype or rank, Fortran order, a size that disagrees with the shape).
    pub fn open(path: &Path) -> Result<Self, RuntimeError> {
        let bad = |why: String| RuntimeError::Trace {
            path: path.display().to_string(),
            why,
        };
        let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        Self::parse(&bytes).map_err(bad)
    }

    fn parse(b: &[u8]) -> Result<Self, String> {
        if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
            return Err("not a NumPy .npy file".into());
        }
        let (hlen, start) = match b[6] {
            1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
            2 | 3 if b.len() >= 12 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
            v => return Err(format!("unsupported .npy version {v}")),
        };
        let header = b
            .get(start..start + hlen)
            .and_then(|h| std::str::from_utf8(h).ok())
            .ok_or("truncated .npy header")?;
        let field = |key: &str| -> Option<&str> {
            let at = header.find(&format!("'{key}':"))? + key.len() + 3;
            Some(header[at..].trim_start())
        };
        let descr = field("descr").ok_or("no descr in the header")?;
        if !(descr.starts_with("'|u1'") || descr.starts_with("'u1'")) {
            return Err(format!("expected uint8 ids, header says {header}"));
        }
        if field("fortran_order").is_none_or(|f| !f.starts_with("False")) {
            return Err("expected C order".into());
        }
        let shape = field("shape").ok_or("no shape in the header")?;
        let inner = shape
            .strip_prefix('(')
            .and_then(|s| s.split(')').next())
            .ok_or("malformed shape")?;
        let dims: Vec<usize> = inner
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<usize>()
                    .map_err(|_| format!("bad dimension '{s}'"))
            })
            .collect::<Result<_, _>>()?;
        let [tokens, layers, top_k] = dims[..] else {
            return Err(format!(
                "expected shape [tokens, layers, top_k], got {dims:?}"
            ));
        };
        Self::from_ids(b[start + hlen..].to_vec(), tokens, layers, top_k)
    }

    /// A trace of `tokens × layers × top_k` ids in C order (token, then layer, then rank).
    ///
    /// Errors: a shape without ids, `ids` of another length, a row naming one expert twice.
    pub fn from_ids(
        ids: Vec<u8>,
        tokens: usize,
        layers: usize,
        top_k: usize,
    ) -> Result<Self, String> {
        let dims = [tokens, layers, top_k];
        let n = tokens
            .checked_mul(layers)
            .and_then(|v| v.checked_mul(top_k))
            .ok_or("shape overflows")?;
        if n == 0 {
            return Err(format!("shape {dims:?} holds no ids"));
        }
        if ids.len() != n {
            return Err(format!(
                "shape {dims:?} needs {n} bytes of ids, the file has {}",
                ids.len()
            ));
        }
        // A router picks distinct experts; a repeat would count one expert twice.
        for (i, row) in ids.chunks_exact(top_k).enumerate() {
            if let Some(j) = (1..top_k).find(|&j| row[..j].contains(&row[j])) {
                return Err(format!(
                    "token {} layer {} names expert {} twice",
                    i / layers,
                    i % layers,
                    row[j]
                ));
            }
        }
        Ok(Self {
            ids,
            tokens,
            layers,
            top_k,
        })
    }

    /// The ids recorded at `layer` for absolute position `pos` (wrapping around at the end).
    pub fn ids(&self, pos: usize, layer: usize) -> &[u8] {
        let o = ((pos % self.tokens) * self.layers + layer) * self.top_k;
        &self.ids[o..o + self.top_k]
    }

    /// The largest expert id in the trace.
    pub fn max_id(&self) -> u8 {
        self.ids.iter().copied().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(header: &str, data: &[u8]) -> Vec<u8> {
        let mut h = header.to_string();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(' ');
        }
        h.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend((h.len() as u16).to_le_bytes());
        b.extend(h.as_bytes());
        b.extend(data);
        b
    }

    #[test]
    fn parses_and_wraps() {
        let data: Vec<u8> = (0..2 * 3 * 2).collect();
        let b = npy(
            "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3, 2), }",
            &data,
        );
        let t = RoutingTrace::parse(&b).unwrap();
        assert_eq!((t.tokens, t.layers, t.top_k), (2, 3, 2));
        assert_eq!(t.ids(1, 2), &[10, 11]);
        assert_eq!(t.ids(3, 0), &[6, 7], "position 3 wraps to token 1");
        assert_eq!(t.max_id(), 11);
    }

    #[test]
    fn refuses_what_it_cannot_replay() {
        let d = [0u8; 12];
        for (h, data, why) in [
            (
                "{'descr': '<i8', 'fortran_order': False, 'shape': (2, 3, 2), }",
                &d[..],
                "uint8",
            ),
            (
                "{'descr': '|u1', 'fortran_order': True, 'shape': (2, 3, 2), }",
                &d[..],
                "C order",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (12,), }",
                &d[..],
                "shape",
            ),
            (
                "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3, 2), }",
                &d[..11],
                "bytes",
            ),
        ] {
            let e = RoutingTrace::parse(&npy(h, data)).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
        assert!(RoutingTrace::parse(b"PK\x03\x04").is_err());
    }
}
