//! Inkling's ops: attention with the relative-position bias (the attention kernels of
//! attention.cu with their `RelArgs`) and the sink router.

use crate::*;

impl InklingOps for CudaBackend {
    fn attention_rel(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        pos0: usize,
        shape: &AttnShape,
        bias: &RelBias<CudaTensor>,
    ) -> OpResult<CudaTensor> {
        self.attention_with("attention_rel", q, kv, pos0, shape, Some(bias), None)
    }

    /// One readback of the logits (`[T, n_routed + n_shared]`, a few hundred floats per row) and
    /// the bias, then the host's routing ([`mference_backend::cpu::sink_routes`]): the expert
    /// ids are needed on the host anyway to plan the layer's expert reads, and the routes are the
    /// CPU backend's bit for bit.
    fn route_sinks(
        &self,
        logits: &CudaTensor,
        router: &SinkRouter<CudaTensor>,
        spec: &RouterSpec,
    ) -> OpResult<Routes> {
        let op = "route_sinks";
        let lg = self.to_host(op, &*logits.buf)?;
        let bias = self.to_host(op, &*router.bias.buf)?;
        mference_backend::cpu::sink_routes(
            &lg,
            logits.cols,
            &bias,
            router.n_shared,
            router.scale,
            spec,
        )
    }
}
