//! Device memory: activation tensors handed back to a reuse pool when dropped (an RAII handle, as
//! llama.cpp's `ggml_cuda_pool_alloc`), the KV store, recurrent state, and the allocation and copy
//! helpers.

use crate::*;

/// Activations `[rows, cols]` f32 in device memory, row-major.
pub struct CudaTensor {
    pub(crate) buf: ManuallyDrop<CudaSlice<f32>>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Where the buffer goes when the tensor is dropped.
    pub(crate) reuse: Arc<Reuse>,
}

impl Drop for CudaTensor {
    fn drop(&mut self) {
        // SAFETY: `buf` is taken once, here, and never used again.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        self.reuse.put(buf);
    }
}

/// Activation buffers given back by dropped tensors, kept by length for the next op that asks
/// for one of that length (decode asks for the same shapes every token): an op then costs one
/// driver call, its launch, instead of an allocation, a launch and a free. Every tensor lives
/// on the one compute stream, so a buffer handed out again while queued kernels still use it
/// is only touched by kernels queued after them.
#[derive(Default)]
pub(crate) struct Reuse(Mutex<ReuseInner>);

#[derive(Default)]
struct ReuseInner {
    pub(crate) free: HashMap<usize, Vec<CudaSlice<f32>>>,
    pub(crate) bytes: usize,
}

/// Bytes of freed activations kept for reuse; beyond it buffers go back to the driver's pool.
const REUSE_BYTES: usize = 256 << 20;

impl Reuse {
    pub(crate) fn take(&self, len: usize) -> Option<CudaSlice<f32>> {
        let mut r = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let buf = r.free.get_mut(&len)?.pop()?;
        r.bytes -= 4 * len;
        Some(buf)
    }

    pub(crate) fn put(&self, buf: CudaSlice<f32>) {
        let len = buf.len();
        let mut r = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if len == 0 || r.bytes + 4 * len > REUSE_BYTES {
            return; // dropped: freed in stream order
        }
        r.bytes += 4 * len;
        r.free.entry(len).or_default().push(buf);
    }
}

impl Tensor for CudaTensor {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

impl CudaTensor {
    pub(crate) fn len(&self) -> usize {
        self.rows * self.cols
    }
}

/// K or V rows on the device.
pub(crate) enum Store {
    F16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// One attention layer's K and V on the device: `rows` rows of `[n_kv_heads, head_dim]`,
/// position `p` in row `p % rows` of a ring (sliding window) or row `p` of a linear layer.
pub struct CudaKv {
    pub(crate) rows: usize,
    pub(crate) ring: bool,
    pub(crate) n_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) k: Store,
    pub(crate) v: Store,
}

impl CudaKv {
    pub(crate) fn width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

impl KvState for CudaKv {
    fn rows(&self) -> usize {
        self.rows
    }
    fn is_ring(&self) -> bool {
        self.ring
    }
    fn bytes(&self) -> usize {
        let elem = match self.k {
            Store::F16(_) => 2,
            Store::F32(_) => 4,
        };
        2 * self.rows * self.width() * elem
    }
}

/// A recurrent f32 state on the device. `clone` is a device-to-device copy (it panics only if
/// the device fails the copy, as `Clone` cannot return an error).
#[derive(Clone)]
pub struct CudaState {
    pub(crate) buf: CudaSlice<f32>,
}

impl CudaBackend {
    pub(crate) fn zeros_f32(&self, op: &'static str, n: usize) -> OpResult<CudaSlice<f32>> {
        self.stream.alloc_zeros(n).map_err(|e| self.dev(op, e))
    }

    /// A tensor over `buf`, given back to the reuse pool when dropped.
    pub(crate) fn wrap(&self, buf: CudaSlice<f32>, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor {
            buf: ManuallyDrop::new(buf),
            rows,
            cols,
            reuse: Arc::clone(&self.reuse),
        }
    }

    /// A tensor the caller's kernel writes in full (no zeroing pass): a reused buffer of that
    /// length, else a fresh one.
    pub(crate) fn uninit_tensor(
        &self,
        op: &'static str,
        rows: usize,
        cols: usize,
    ) -> OpResult<CudaTensor> {
        let len = rows * cols;
        let buf = match self.reuse.take(len) {
            Some(b) => b,
            // SAFETY: the one kernel that writes it covers every element before anything
            // reads it (stream order).
            None => unsafe { self.stream.alloc::<f32>(len) }.map_err(|e| self.dev(op, e))?,
        };
        Ok(self.wrap(buf, rows, cols))
    }

    pub(crate) fn tensor(
        &self,
        op: &'static str,
        rows: usize,
        cols: usize,
    ) -> OpResult<CudaTensor> {
        let mut t = self.uninit_tensor(op, rows, cols)?;
        self.stream
            .memset_zeros(&mut *t.buf)
            .map_err(|e| self.dev(op, e))?;
        Ok(t)
    }

    pub(crate) fn to_device<T: cudarc::driver::DeviceRepr>(
        &self,
        op: &'static str,
        v: &[T],
    ) -> OpResult<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(|e| self.dev(op, e))
    }

    pub(crate) fn to_host<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        op: &'static str,
        v: &CudaSlice<T>,
    ) -> OpResult<Vec<T>> {
        let t0 = self.profile.as_ref().map(|_| std::time::Instant::now());
        let out = self.stream.clone_dtoh(v).map_err(|e| self.dev(op, e))?;
        self.stream.synchronize().map_err(|e| self.dev(op, e))?;
        if let (Some((_, p)), Some(t0)) = (&self.profile, t0) {
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            let e = p.entry((op, "(readback)")).or_default();
            e.0 += 1;
            e.1 += t0.elapsed();
        }
        Ok(out)
    }

    /// A device copy of a small host constant, uploaded once per distinct value.
    pub(crate) fn constant(&self, op: &'static str, v: &[f32]) -> OpResult<Arc<CudaSlice<f32>>> {
        let key: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        let mut kept = self.consts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, s)) = kept.iter().find(|(k, _)| *k == key) {
            return Ok(s.clone());
        }
        let s = Arc::new(self.to_device(op, v)?);
        if kept.len() >= CONSTS_KEPT {
            // Frees in stream order: a queued kernel still reading it is unaffected.
            kept.remove(0);
        }
        kept.push((key, s.clone()));
        Ok(s)
    }

    /// The device address of a buffer (event tracking is off, so no guard is needed).
    pub(crate) fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// The kernel for `kv`'s dtype (`f16` or `f32`) and the device addresses of its K and V.
    pub(crate) fn kv_ptrs(
        &self,
        kv: &CudaKv,
        f16: &'static str,
        f32: &'static str,
    ) -> (&'static str, u64, u64) {
        match (&kv.k, &kv.v) {
            (Store::F16(k), Store::F16(v)) => (f16, self.addr(k), self.addr(v)),
            (Store::F32(k), Store::F32(v)) => (f32, self.addr(k), self.addr(v)),
            _ => unreachable!("new_kv gives K and V one dtype"),
        }
    }
}
