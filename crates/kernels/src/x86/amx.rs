//! AMX (Advanced Matrix Extensions, Intel Sapphire Rapids and later) GEMM for the int16-activation
//! products, `--kernels amx`: the `avx512i16` table with its prompt GEMM (6+ tokens) on AMX-INT8 tiles. The
//! numbers are those of `avx512i16`, bit for bit.
//!
//! `avx512i16` multiplies a 4-bit code `q` (0..15) with an int16 activation code `c` into exact
//! integer sums per (row, token, weight group). AMX multiplies bytes only, so each `c` is split
//! exactly as `c = 256 · hi + lo` (`hi` signed, `lo` unsigned, [`XLayout::Q16Amx`]) and
//! `Σ q·c = 256 · Σ q·hi + Σ q·lo`: `tdpbusd` (unsigned codes × signed `hi`) and `tdpbuud` (× unsigned
//! `lo`), 16 weight rows × 16 tokens × 64 columns each, 16,384 multiply-adds per instruction. The
//! sums are exact (|Σ q·c| <= 15 · 32767 · 128 < 2^31) whatever the order, so the f32 side that
//! follows — per group `acc = fma(isum, scale · d, acc)`, then `acc = fma(bias, Σ x, acc)`, groups in
//! order — gives the int16 GEMV's bits: a prompt row does not depend on its chunk (batch invariance).
//!
//! Tiles (one configuration for every call: 8 tiles of 16 rows × 64 bytes): tmm0 the codes of 16
//! weight rows (one byte per code, natural column order, `avx512_vnni::widen_row`), tmm1 / tmm2 a
//! token block's `hi` / `lo` bytes, tmm3 + tmm4 and tmm5 + tmm6 the integer sums of even and odd
//! groups (so the vector side of one group overlaps the tile products of the next).
//!
//! Linux hands out the tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`, see the kernel's Documentation/arch/x86/xstate.rst); [`supported`] asks once
//! for the process and is false where it is refused.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{avx512_q16, read_bf16, with_wtile};
use crate::dispatch::Kernels;
use crate::prepared::{PreparedX, XLayout};
use crate::QMatrix;

pub(super) fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| avx512_q16::supported() && cpu_has_amx_int8() && request_tile_state())
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25); and the OS enables the tile state
/// in XCR0 (bits 17, 18). (`is_x86_feature_detected!` does not know AMX on stable Rust yet.)
fn cpu_has_amx_int8() -> bool {
    // CPUID is always present on x86-64; leaf 7 is valid when the max leaf is >= 7.
    let leaf7 = __cpuid(0).eax >= 7 && (__cpuid_count(7, 0).edx >> 24) & 3 == 3;
    // XGETBV needs OSXSAVE (CPUID.1:ECX bit 27), which AVX-512 (checked before this) implies.
    leaf7 && {
        // SAFETY: OSXSAVE is set (see above), so XGETBV with ECX = 0 is valid.
        let xcr0 = unsafe { _xgetbv(0) };
        (xcr0 >> 17) & 3 == 3
    }
}

/// Asks Linux for the AMX tile data state for this process (all threads, present and future).
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request reads no memory; it only grants (or refuses) a permission.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

/// Only reachable after [`supported`] returned true (see `super::available`).
pub(super) static TABLE: Kernels = Kernels {
    name: "amx",
    amx: true,
    gemm,
    ..avx512_q16::TABLE
};

fn gemm(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    if TABLE.layout_for(m.bits, m.group_size, p.n) != XLayout::Q16Amx {
        // Fewer tokens, or not a 4-bit matrix with groups of 64 / 128: the int16 (or exact) kernels.
        return avx512_q16::gemm(m, p, y, r0, r1);
    }
    p.check(m, XLayout::Q16Amx);
    // SAFETY: AMX-TILE/INT8 with the tile state granted, and AVX-512F/BW/VL, VNNI and FMA are
    // present (the table is handed out only after `supported()`); the caller checked r0 <= r1 <=
    // rows and y.len() == n · (r1 - r0).
    unsafe { gemm_tiles(m, p, y, r0, r1) }
}

/// Weight rows per tile (the tile height).
const ROWS: usize = 16;

/// The tile configuration (palette 1): tiles 0..8 of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
        c[48 + t] = 16; // rows
        t += 1;
    }
    TileConfig(c)
};

/// Weight-row strips per pass: each token block's `hi` / `lo` tiles of a group are loaded once for
/// all of them (the activations are the operand read most; this keeps them out of the L2 traffic).
const STRIPS: usize = 8;

/// Widens rows `r..r + rows` (at most `STRIPS · ROWS`) of a 4-bit matrix to one byte per code in
/// column order, as A tiles: strip `s`, 64-column step `k`, row `i` at `((s · steps + k) · 16 + i) · 64`
/// (`steps = cols / 64`), each tile 1 KiB contiguous. Rows past `rows` in the last strip are zero.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen_tiles(m: &QMatrix, r: usize, rows: usize, dst: *mut u8) {
    let (rb, steps) = (m.row_bytes(), m.cols / 64);
    let (low, high) = (_mm512_set1_epi16(0x000f), _mm512_set1_epi16(0x0f00));
    for i in 0..rows {
        let (s, ii) = (i / ROWS, i % ROWS);
        for k in 0..steps {
            // SAFETY: 32 packed bytes of row r + i at 32k (rb = cols / 2); the tile slot is inside
            // the buffer of STRIPS · ROWS · cols bytes.
            unsafe {
                let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                    m.weight.as_ptr().add((r + i) * rb + 32 * k) as *const __m256i,
                ));
                // A packed byte holds columns 2j, 2j+1 in its low, high nibble: one byte each.
                let w = _mm512_or_si512(
                    _mm512_and_si512(v, low),
                    _mm512_and_si512(_mm512_slli_epi16::<4>(v), high),
                );
                _mm512_storeu_si512(
                    dst.add(((s * steps + k) * ROWS + ii) * 64) as *mut __m512i,
                    w,
                );
            }
        }
    }
    let pad = rows.div_ceil(ROWS) * ROWS - rows;
    if pad > 0 {
        let s = rows / ROWS;
        for k in 0..steps {
            // SAFETY: rows rows % 16.. of the last strip's tile of step k.
            unsafe {
                std::ptr::write_bytes(
                    dst.add(((s * steps + k) * ROWS + rows % ROWS) * 64),
                    0,
                    pad * 64,
                )
            };
        }
    }
}

/// Rows `[r0, r1)` of `Y = X · Wᵀ` for a [`XLayout::Q16Amx`] activation: per pass of up to
/// [`STRIPS`] strips of 16 rows their codes widened once into A tiles; then per 16-token block and
/// group the block's `hi` / `lo` tiles loaded once, and per strip the tile products, their sums
/// stored, and the f32 side (`acc`, per (row, token), kept in memory across groups).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn gemm_tiles(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    let (cols, gs, gpr) = (m.cols, m.group_size, m.groups_per_row());
    let (n, ldy) = (p.n, r1 - r0);
    let (blocks, steps) = (n.div_ceil(16), cols / 64);
    // The `lo` halves follow every block's `hi` half in `p.q` (see `XLayout::Q16Amx`).
    let q_hi = p.q.as_ptr() as *const u8;
    // SAFETY: `q` holds 2 · blocks · 16 · cols bytes.
    let q_lo = unsafe { q_hi.add(blocks * 16 * cols) };
    // SAFETY: loads the configuration above (valid for palette 1); released at the end.
    unsafe { asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly)) };
    let pass = STRIPS * ROWS;
    // A tiles (pass · cols bytes), two strips' integer sums (2 · 512 i32), f32 sums (pass · 16),
    // the pass's scales and biases as f32 (`[row][group]`, 2 · pass · gpr).
    with_wtile(pass * cols / 4 + 1024 + pass * 16 + 2 * pass * gpr, |buf| {
        let (codes, rest) = buf.split_at_mut(pass * cols / 4);
        let (isums, rest) = rest.split_at_mut(1024);
        let (acc, rest) = rest.split_at_mut(pass * 16);
        let (scf, bif) = rest.split_at_mut(pass * gpr);
        let codes = codes.as_mut_ptr() as *mut u8;
        let isums = isums.as_mut_ptr() as *mut i32;
        let mut r = r0;
        while r < r1 {
            let rows = (r1 - r).min(pass);
            let strips = rows.div_ceil(ROWS);
            // SAFETY: rows r..r + rows exist; the buffer holds pass · cols bytes.
            unsafe { widen_tiles(m, r, rows, codes) };
            for (i, (sf, bf)) in scf
                .chunks_exact_mut(gpr)
                .zip(bif.chunks_exact_mut(gpr))
                .take(rows)
                .enumerate()
            {
                for g in 0..gpr {
                    // SAFETY: group g of row r + i.
                    unsafe {
                        let at = ((r + i) * gpr + g) * 2;
                        sf[g] = read_bf16(m.scales.as_ptr().add(at));
                        bf[g] = read_bf16(m.biases.as_ptr().add(at));
                    }
                }
            }
            for b in 0..blocks {
                acc[..rows * 16].fill(0.0);
                for g in 0..gpr {
                    let at = (b * gpr + g) * 16;
                    // SAFETY: qd and sums hold [blocks, gpr, 16] floats.
                    let (d, sum) = unsafe {
                        (
                            _mm512_loadu_ps(p.qd.as_ptr().add(at)),
                            _mm512_loadu_ps(p.sums.as_ptr().add(at)),
                        )
                    };
                    let k0 = g * gs / 64;
                    // The f32 side of strip s (its integer sums at `out`) for group g.
                    let mut side = |s: usize, out: *const i32| {
                        for i in 0..(rows - s * ROWS).min(ROWS) {
                            let row = s * ROWS + i;
                            // SAFETY: `out` row i of each half is 16 i32; `acc` holds 16 floats per
                            // row of the pass; scf / bif hold gpr floats per row.
                            unsafe {
                                let hi = _mm512_loadu_si512(out.add(i * 16) as *const __m512i);
                                let lo =
                                    _mm512_loadu_si512(out.add(256 + i * 16) as *const __m512i);
                                let isum = _mm512_add_epi32(_mm512_slli_epi32::<8>(hi), lo);
                                let sd = _mm512_mul_ps(
                                    _mm512_set1_ps(*scf.get_unchecked(row * gpr + g)),
                                    d,
                                );
                                let bias = _mm512_set1_ps(*bif.get_unchecked(row * gpr + g));
                                let ap = acc.as_mut_ptr().add(row * 16);
                                let mut a = _mm512_loadu_ps(ap);
                                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, a);
                                a = _mm512_fmadd_ps(bias, sum, a);
                                _mm512_storeu_ps(ap, a);
                            }
                        }
                    };
                    // SAFETY: block b's halves hold this group's 64-column steps (1 KiB each);
                    // the configuration is loaded.
                    unsafe {
                        load_block(
                            q_hi.add((b * cols + g * gs) * 16),
                            q_lo.add((b * cols + g * gs) * 16),
                            gs / 64,
                        )
                    };
                    // Strip s's tile products are issued before strip s - 1's f32 side, which
                    // then runs on the vector ports while the tiles compute.
                    for s in 0..strips {
                        // SAFETY: strip s's A tiles of steps k0.. exist; each `out` has 512 i32.
                        unsafe {
                            let a = codes.add((s * steps + k0) * ROWS * 64);
                            strip_sums(a, gs / 64, s % 2 == 1, isums.add((s % 2) * 512));
                        }
                        if s > 0 {
                            // SAFETY: the other half of `isums`.
                            side(s - 1, unsafe { isums.add(((s - 1) % 2) * 512) });
                        }
                    }
                    // SAFETY: as above.
                    side(strips - 1, unsafe { isums.add(((strips - 1) % 2) * 512) });
                }
                store_block(&acc[..rows * 16], b, n, y, r - r0, ldy);
            }
            r += rows;
        }
    });
    // SAFETY: gives the tile state back (the next call loads the configuration again).
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Loads a token block's `hi` / `lo` tiles of one group of `steps` (1 or 2) 64-column steps (1 KiB
/// per step at `bh` / `bl`): tmm1 / tmm2, and tmm5 / tmm6 for a second step.
///
/// # Safety
/// The tile configuration is loaded; the pointers are valid for `steps` KiB.
#[inline(always)]
unsafe fn load_block(bh: *const u8, bl: *const u8, steps: usize) {
    // SAFETY: the caller's contract; tiles are 16 rows of 64 bytes, stride 64.
    unsafe {
        asm!(
            "tileloadd tmm1, [{bh} + {ld}*1]",
            "tileloadd tmm2, [{bl} + {ld}*1]",
            bh = in(reg) bh, bl = in(reg) bl, ld = in(reg) 64usize,
            options(nostack, readonly),
        );
        if steps == 2 {
            asm!(
                "tileloadd tmm5, [{bh} + {ld}*1]",
                "tileloadd tmm6, [{bl} + {ld}*1]",
                bh = in(reg) bh.add(1024), bl = in(reg) bl.add(1024), ld = in(reg) 64usize,
                options(nostack, readonly),
            );
        }
    }
}

/// One strip's integer sums for the group whose block tiles [`load_block`] loaded: A tiles at `a`
/// (1 KiB per step); stores the `hi` sums to `out[0..256]` and the `lo` sums to `out[256..512]`
/// (`[16 rows][16 tokens]` i32 each). In one-step groups, `odd` strips use the other sum tiles
/// (tmm5, tmm6) and A tile (tmm7), so that one strip's stores and vector side overlap the next
/// strip's products; two-step groups use tmm3 / tmm4 with A tiles tmm0 / tmm7.
///
/// # Safety
/// The tile configuration is loaded; the pointers are valid for the sizes above.
#[inline(always)]
unsafe fn strip_sums(a: *const u8, steps: usize, odd: bool, out: *mut i32) {
    // SAFETY (every block): the caller's contract; tiles are 16 rows of 64 bytes, stride 64.
    unsafe {
        if steps == 1 && !odd {
            asm!(
                "tileloadd tmm0, [{a} + {ld}*1]",
                "tilezero tmm3",
                "tilezero tmm4",
                "tdpbusd tmm3, tmm0, tmm1",
                "tdpbuud tmm4, tmm0, tmm2",
                "tilestored [{o} + {ld}*1], tmm3",
                "tilestored [{o2} + {ld}*1], tmm4",
                a = in(reg) a, o = in(reg) out, o2 = in(reg) out.add(256), ld = in(reg) 64usize,
                options(nostack),
            );
        } else if steps == 1 {
            asm!(
                "tileloadd tmm7, [{a} + {ld}*1]",
                "tilezero tmm5",
                "tilezero tmm6",
                "tdpbusd tmm5, tmm7, tmm1",
                "tdpbuud tmm6, tmm7, tmm2",
                "tilestored [{o} + {ld}*1], tmm5",
                "tilestored [{o2} + {ld}*1], tmm6",
                a = in(reg) a, o = in(reg) out, o2 = in(reg) out.add(256), ld = in(reg) 64usize,
                options(nostack),
            );
        } else {
            asm!(
                "tileloadd tmm0, [{a} + {ld}*1]",
                "tileloadd tmm7, [{a2} + {ld}*1]",
                "tilezero tmm3",
                "tilezero tmm4",
                "tdpbusd tmm3, tmm0, tmm1",
                "tdpbuud tmm4, tmm0, tmm2",
                "tdpbusd tmm3, tmm7, tmm5",
                "tdpbuud tmm4, tmm7, tmm6",
                "tilestored [{o} + {ld}*1], tmm3",
                "tilestored [{o2} + {ld}*1], tmm4",
                a = in(reg) a, a2 = in(reg) a.add(1024),
                o = in(reg) out, o2 = in(reg) out.add(256), ld = in(reg) 64usize,
                options(nostack),
            );
        }
    }
}

/// Writes `acc` (`[rows][16 tokens]` for rows `row0..` of `y`'s columns, tokens of block `b`) to
/// `y[t · ldy + row0 + i]` for tokens `t < n`.
fn store_block(acc: &[f32], b: usize, n: usize, y: &mut [f32], row0: usize, ldy: usize) {
    let t0 = b * 16;
    let rows = acc.len() / 16;
    for l in 0..(n - t0).min(16) {
        let dst = &mut y[(t0 + l) * ldy + row0..][..rows];
        for (i, d) in dst.iter_mut().enumerate() {
            *d = acc[i * 16 + l];
        }
    }
}

#[cfg(test)]
mod tests {
    /// The configuration asks for 8 tiles of 16 × 64 bytes under palette 1.
    #[test]
    fn config_is_eight_full_tiles() {
        let c = &super::CONFIG.0;
        assert_eq!(c[0], 1);
        for t in 0..8 {
            assert_eq!(u16::from_le_bytes([c[16 + 2 * t], c[17 + 2 * t]]), 64);
            assert_eq!(c[48 + t], 16);
        }
        assert!(c[8 + 48..].iter().all(|&v| v == 0));
    }
}
