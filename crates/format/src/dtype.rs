//! Element types of resident entries and expert tensors.

/// Element type of a stored tensor. The discriminant is the `dtype` byte of a resident
/// index entry (`docs/FORMAT.md`, `model_weights.bin`): 0 = U32 (packed MLX affine codes),
/// 1 = BF16, 2 = F16, 3 = F32, 4 = I64, 5 = I32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    U32 = 0,
    BF16 = 1,
    F16 = 2,
    F32 = 3,
    I64 = 4,
    I32 = 5,
}

impl Dtype {
    /// The on-disk code (0..=5).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// Inverse of [`Dtype::code`]; `None` for an unknown code.
    pub fn from_code(code: u8) -> Option<Dtype> {
        Some(match code {
            0 => Dtype::U32,
            1 => Dtype::BF16,
            2 => Dtype::F16,
            3 => Dtype::F32,
            4 => Dtype::I64,
            5 => Dtype::I32,
            _ => return None,
        })
    }

    /// Parse a safetensors dtype string (`"U32"`, `"BF16"`, ...); `None` if unsupported.
    pub fn from_safetensors(s: &str) -> Option<Dtype> {
        Some(match s {
            "U32" => Dtype::U32,
            "BF16" => Dtype::BF16,
            "F16" => Dtype::F16,
            "F32" => Dtype::F32,
            "I64" => Dtype::I64,
            "I32" => Dtype::I32,
            _ => return None,
        })
    }

    /// The name used in safetensors headers and `layout.json` (`"U32"`, `"BF16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::U32 => "U32",
            Dtype::BF16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::U32 | Dtype::F32 | Dtype::I32 => 4,
            Dtype::I64 => 8,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
