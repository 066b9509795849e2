//! The kernels: the `.cu` sources under `ops/` compiled at startup by NVRTC into a cubin for the
//! device's compute capability, cached on disk.
//!
//! A cache entry is named by the SHA-256 of everything that determines its bytes (the source,
//! the target `sm_XY`, the NVRTC version, the driver's CUDA version, the options) and carries the
//! SHA-256 of its own payload: a truncated or corrupt file is recompiled and rewritten, never
//! loaded. Entries are written to a temporary file and renamed, so a reader sees a whole entry or
//! none. A cache that cannot be read or written costs a compile, nothing else.

use std::ffi::{c_char, CString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use sha2::{Digest, Sha256};

use crate::CudaError;

/// The shared helpers, then every kernel file beside its module under `ops/`: one translation
/// unit, one module (`norm.cu` after `attention.cu`, whose `rope_pair` it uses).
pub(crate) const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("ops/common.cuh")),
    ("elementwise.cu", include_str!("ops/elementwise.cu")),
    ("quant.cu", include_str!("ops/quant.cu")),
    ("gemm.cu", include_str!("ops/gemm.cu")),
    ("attention.cu", include_str!("ops/attention.cu")),
    ("deepseek_v4.cu", include_str!("ops/deepseek_v4.cu")),
    ("norm.cu", include_str!("ops/norm.cu")),
    ("recurrent.cu", include_str!("ops/recurrent.cu")),
    ("router.cu", include_str!("ops/router.cu")),
    ("moe.cu", include_str!("ops/moe.cu")),
];

/// NVRTC options besides the target (no fast-math: the math builtins keep their ulp bounds).
const OPTIONS: [&str; 1] = ["--std=c++17"];

const MAGIC: &[u8; 8] = b"MFCUBIN1";

/// The concatenated kernel source, each file introduced by a `#line` so NVRTC's messages name it.
///
/// `MFERENCE_CUDA_QM_UNROLL=N` (1-16) defines `QM_UNROLL` (ops/quant.cu: code words each
/// lane of `qmatmul` loads per step) ahead of the sources, `QV_R` is [`qv_rows`] and `QV_U`
/// [`qv_unroll`], so the cache keeps one entry per value.
pub(crate) fn source() -> String {
    let mut s = format!(
        "#define QV_R {}\n#define QV_U {}\n#define QV_STAGE {}\n#define DC_R2 {}\n#define QT_TERMS {}\n#define QV_PF {}\n",
        qv_rows(),
        qv_unroll(),
        qv_stage(),
        dc_rows(2),
        qt_terms(),
        qv_prefetch()
    );
    if let Some(n) = std::env::var("MFERENCE_CUDA_QM_UNROLL")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|n| (1..=16).contains(n))
    {
        s.push_str(&format!("#define QM_UNROLL {n}\n"));
    }
    for (name, text) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// A kernel knob from the environment variable `var` (one of `allowed`), else `default`; read
/// once per process into `cell`.
fn knob(
    cell: &'static std::sync::OnceLock<usize>,
    var: &str,
    allowed: &[usize],
    default: usize,
) -> usize {
    *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| allowed.contains(n))
            .unwrap_or(default)
    })
}

/// Rows a `qmv` lane group multiplies by one load of x (ops/quant.cu `QV_R`; a gated pair takes
/// half of them each): 2 (measured on an H200, full-size Gemma 4 decode: 132.6 tok/s at 2, 125.5
/// at 4, 107.4 at 8), or `MFERENCE_CUDA_QV_ROWS` (2, 4 or 8; for measurements). The launch's grid
/// uses the same value.
pub(crate) fn qv_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    knob(&ROWS, "MFERENCE_CUDA_QV_ROWS", &[2, 4, 8], 2)
}

/// Words a `qmv` lane loads for each of its rows before multiplying them (ops/quant.cu `QV_U`;
/// the result is the same bits at every value): 2, or `MFERENCE_CUDA_QV_UNROLL` (1, 2, 4 or 8;
/// for measurements).
pub(crate) fn qv_unroll() -> usize {
    static UNROLL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    knob(&UNROLL, "MFERENCE_CUDA_QV_UNROLL", &[1, 2, 4, 8], 2)
}

/// The widest products whose `qmv` stages x in shared memory (ops/quant.cu `QV_STAGE`; the same
/// bits either way): 2 (DeepSeek-V4's 2-bit experts: +3.5% decode on a 6-layer cut, H100; Gemma
/// 4 26B's 4-bit products measured no faster), or `MFERENCE_CUDA_QV_STAGE` (0 = none, 2, 4 or 8;
/// for measurements).
pub(crate) fn qv_stage() -> usize {
    static STAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    knob(&STAGE, "MFERENCE_CUDA_QV_STAGE", &[0, 2, 4, 8], 2)
}

/// The most passes a staged `qmv` block takes over its lane groups' rows (launch.rs `qmv_grid`
/// chooses per launch; the same bits at every value): 4, or `MFERENCE_CUDA_QV_PASSES` (1 or 4;
/// for measurements).
pub(crate) fn qv_passes() -> usize {
    static PASSES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    knob(&PASSES, "MFERENCE_CUDA_QV_PASSES", &[1, 4], 4)
}

/// Whether the resident one-row products prefetch their block's rows into L2 before waiting for
/// the previous kernel (ops/quant.cu `QV_PF`; the same bits either way): 1, or
/// `MFERENCE_CUDA_QV_PREFETCH=0` (for measurements).
pub(crate) fn qv_prefetch() -> usize {
    static PF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    knob(&PF, "MFERENCE_CUDA_QV_PREFETCH", &[0, 1], 1)
}

/// Rows of a `qmv_down_combine` row group at `bits` bits (ops/moe.cu: `DC_R2` at 2 bits, else
/// `QV_R`; the same bits at every value): [`qv_rows`], and at 2 bits 4 (DeepSeek-V4's experts:
/// +3.5% decode on a 6-layer cut, H100) or `MFERENCE_CUDA_DC_ROWS` (2, 4 or 8; for
/// measurements). The launch's grid uses the same value.
pub(crate) fn dc_rows(bits: usize) -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if bits == 2 {
        knob(&ROWS, "MFERENCE_CUDA_DC_ROWS", &[2, 4, 8], 4)
    } else {
        qv_rows()
    }
}

/// BF16 terms of x in the tensor-core prefill products (ops/gemm.cu `QT_TERMS`): 3 (x to ~24
/// significant bits, within the op harness's f32 budget), or `MFERENCE_CUDA_QT_TERMS` (1, 2 or
/// 3; for measurements).
/// Fewer than 3 rounds x beyond the f32 budget, so it is said on stderr (once).
pub(crate) fn qt_terms() -> usize {
    static TERMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    static SAID: std::sync::Once = std::sync::Once::new();
    let n = knob(&TERMS, "MFERENCE_CUDA_QT_TERMS", &[1, 2, 3], 3);
    if n < 3 {
        SAID.call_once(|| {
            eprintln!(
                "mference: MFERENCE_CUDA_QT_TERMS={n}: prompt products on CUDA round x to ~{} \
                 bits (not f32-exact; for measurements)",
                8 * n
            )
        });
    }
    n
}

/// What determines a compiled image.
pub(crate) struct Target {
    /// `sm_90` for compute capability 9.0.
    pub arch: String,
    /// NVRTC `(major, minor)`.
    pub nvrtc: (i32, i32),
    /// `cuDriverGetVersion` (13000 for CUDA 13.0).
    pub driver: i32,
}

/// Where the cache lives: `$XDG_CACHE_HOME/mference/cuda`, else `$HOME/.cache/mference/cuda`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let nonempty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(x) = nonempty("XDG_CACHE_HOME") {
        return Some(PathBuf::from(x).join("mference/cuda"));
    }
    nonempty("HOME").map(|h| PathBuf::from(h).join(".cache/mference/cuda"))
}

/// The cache file of `src` compiled for `t`.
pub(crate) fn entry_path(dir: &Path, src: &str, t: &Target) -> PathBuf {
    let mut h = Sha256::new();
    h.update(b"mference-cuda kernels\0");
    h.update(src.as_bytes());
    h.update(
        format!(
            "\0{}\0nvrtc {}.{}\0driver {}\0{}",
            t.arch,
            t.nvrtc.0,
            t.nvrtc.1,
            t.driver,
            OPTIONS.join(" ")
        )
        .as_bytes(),
    );
    dir.join(format!("{}.cubin", hex(&h.finalize())))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The payload of a cache entry, or `None` if it is missing, truncated or fails its checksum.
pub(crate) fn read_entry(path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    let (head, payload) = bytes.split_at_checked(MAGIC.len() + 32 + 8)?;
    let (magic, rest) = head.split_at(MAGIC.len());
    let (sum, len) = rest.split_at(32);
    let len = u64::from_le_bytes(len.try_into().ok()?);
    if magic != MAGIC || len != payload.len() as u64 || Sha256::digest(payload)[..] != sum[..] {
        return None;
    }
    Some(payload.to_vec())
}

/// Writes a cache entry (temporary file, then rename).
pub(crate) fn write_entry(path: &Path, payload: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    // Unique per writer (process and call), so two writers never share a temporary file.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(MAGIC)?;
    f.write_all(&Sha256::digest(payload))?;
    f.write_all(&(payload.len() as u64).to_le_bytes())?;
    f.write_all(payload)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// NVRTC's version.
pub(crate) fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for one write; the caller checked the library is present.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Compile {
            arch: String::new(),
            log: format!("nvrtcVersion: {e:?}"),
        })?;
    Ok((major, minor))
}

/// Compiles `src` to a cubin for `arch` (`sm_90`).
pub(crate) fn compile_cubin(src: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    let fail = |log: String| CudaError::Compile {
        arch: arch.to_string(),
        log,
    };
    let csrc = CString::new(src).map_err(|_| fail("the source holds a NUL byte".into()))?;
    let prog = nvrtc::create_program(&csrc, Some(c"mference.cu"))
        .map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut opts: Vec<String> = vec![format!("--gpu-architecture={arch}")];
    opts.extend(OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: `prog` is a live program created above (with `csrc` alive until it is destroyed);
    // the CUBIN buffer is sized by nvrtcGetCUBINSize; the program is destroyed once, at the end.
    let out = unsafe {
        let compiled = nvrtc::compile_program(prog, &opts);
        let out = match compiled {
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| {
                        let b: Vec<u8> =
                            l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                        String::from_utf8_lossy(&b).into_owned()
                    })
                    .unwrap_or_default();
                Err(fail(format!("{e:?}: {log}")))
            }
            Ok(()) => {
                let mut n = 0usize;
                match nvrtc_sys::nvrtcGetCUBINSize(prog, &mut n).result() {
                    Err(e) => Err(fail(format!("nvrtcGetCUBINSize: {e:?}"))),
                    Ok(()) => {
                        let mut buf = vec![0u8; n];
                        nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                            .result()
                            .map(|()| buf)
                            .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))
                    }
                }
            }
        };
        let _ = nvrtc::destroy_program(prog);
        out
    };
    drop(csrc);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            arch: "sm_90".into(),
            nvrtc: (13, 0),
            driver: 13000,
        }
    }

    #[test]
    fn an_entry_reads_back_and_a_damaged_one_does_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = entry_path(dir.path(), "src", &target());
        assert!(read_entry(&path).is_none(), "missing");
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        write_entry(&path, &payload).expect("write");
        assert_eq!(read_entry(&path).as_deref(), Some(&payload[..]));
        let good = std::fs::read(&path).expect("read");
        // One flipped payload byte, a flipped checksum byte, a truncation, a wrong length field.
        for damage in 0..4 {
            let mut b = good.clone();
            match damage {
                0 => *b.last_mut().expect("payload") ^= 1,
                1 => b[MAGIC.len()] ^= 0x80,
                2 => b.truncate(b.len() - 1),
                _ => b[MAGIC.len() + 32] ^= 1,
            }
            std::fs::write(&path, &b).expect("write");
            assert!(read_entry(&path).is_none(), "damage {damage} was accepted");
        }
        std::fs::write(&path, b"MFCUBIN1").expect("write");
        assert!(read_entry(&path).is_none(), "a header alone was accepted");
    }

    #[test]
    fn the_key_changes_with_source_arch_nvrtc_and_driver() {
        let d = Path::new("/c");
        let base = entry_path(d, "src", &target());
        assert_eq!(base, entry_path(d, "src", &target()));
        let mut others = vec![entry_path(d, "src2", &target())];
        let mut t = target();
        t.arch = "sm_89".into();
        others.push(entry_path(d, "src", &t));
        let mut t = target();
        t.nvrtc = (13, 1);
        others.push(entry_path(d, "src", &t));
        let mut t = target();
        t.driver = 13010;
        others.push(entry_path(d, "src", &t));
        for o in others {
            assert_ne!(o, base);
        }
    }

    /// NVRTC needs no GPU: where its library is on the loader path, the kernels must compile
    /// for Hopper and define every kernel the backend loads.
    #[test]
    fn the_kernels_compile_where_nvrtc_is_present() {
        // SAFETY: the probe only opens and closes the candidate libraries.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped the NVRTC compile: libnvrtc.so is not on the loader path");
            return;
        }
        let cubin = compile_cubin(&source(), "sm_90").unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.starts_with(b"\x7fELF"), "not an ELF cubin");
        for k in crate::device::KERNELS {
            let name = k.as_bytes();
            assert!(
                cubin
                    .windows(name.len() + 1)
                    .any(|w| &w[..name.len()] == name && w[name.len()] == 0),
                "kernel {k} is not defined"
            );
        }
    }

    #[test]
    fn every_kernel_file_is_in_the_source() {
        let s = source();
        for (name, text) in SOURCES {
            assert!(s.contains(&format!("#line 1 \"{name}\"")) && s.contains(text));
        }
    }
}
