//! The routed-experts step of one MoE layer, written once for every family and backend
//! (`docs/ARCHITECTURE.md`, "The MoE step"): plan the router's experts against the layer's slot
//! cache in tiles, compute the experts already cached while the misses are read, start the next tile's
//! reads before computing this tile's misses, and combine in expert order, so the result never
//! depends on which experts happened to be cached or on the slot count. A backend with its own
//! expert cache (GPU slots) is asked first: experts it holds are computed before any host read,
//! the others are copied in from the host slots as they land, or, for the share of a decode row's
//! misses the backend asks for (`DeviceExpertOps::host_misses`), computed on the host CPU from
//! the host slots meanwhile (`DeviceExpertOps::glu_mlp_combine_split`).

use mference_runtime::{ExpertStreamer, RuntimeError};

use crate::{Act, Backend, Mlp, OpError, OpResult, RouterSpec, Routes, Tensor, Weights};

/// Router lookahead for one decode step of [`route_and_run`] (`docs/ARCHITECTURE.md`, "Reads
/// ahead of the router"): the next MoE layer's streamer, that layer's router applied to this
/// layer's post-attention state (one row), and how many of its heaviest experts to bring in.
pub struct Lookahead<'a> {
    pub next: &'a mut ExpertStreamer,
    pub predicted: &'a Routes,
    pub n: usize,
}

impl<'a> Lookahead<'a> {
    /// The lookahead when there is a next layer and a prediction for it, else none.
    pub fn of(
        next: Option<&'a mut ExpertStreamer>,
        predicted: Option<&'a Routes>,
        n: usize,
    ) -> Option<Self> {
        let (next, predicted) = next.zip(predicted)?;
        Some(Self { next, predicted, n })
    }
}

/// Routes the rows of `x` by `logits` (`[T, num_experts]`) and runs their experts: for one row
/// of a layer whose experts the backend holds for good ([`DeviceExpertOps::routes_on_device`]) without a
/// readback ([`DeviceExpertOps::routed_experts_held`], after `meanwhile`), otherwise through
/// [`CoreOps::route`] and [`routed_experts`]. Both give the same bits. Returns what
/// [`routed_experts`] returns and the router's margins (empty unless `spec.trace`).
///
/// `ahead` (decode): the next layer's predicted experts are read into its host slots once this
/// step's reads are queued ([`prefetch_predicted`]), or, for a backend with its own expert
/// cache, copied from its host slots into that cache once this step's own copies are queued
/// ([`DeviceExpertOps::prefetch_expert`]). The cached bytes are the file's, so results do not
/// change, except where a split computes some misses on the host
/// ([`DeviceExpertOps::host_misses`]): a lookahead hit changes which misses those are, and the host
/// rounds differently (within the op tolerances).
///
/// Errors: as [`CoreOps::route`] and [`routed_experts`].
#[allow(clippy::too_many_arguments)]
pub fn route_and_run<B, S, E>(
    be: &B,
    streamer: &mut ExpertStreamer,
    experts: &Mlp,
    act: Act,
    x: &B::Tensor,
    logits: &B::Tensor,
    spec: &RouterSpec,
    ahead: Option<Lookahead>,
    meanwhile: impl FnOnce() -> Result<(S, B::Tensor), E>,
) -> Result<(S, B::Tensor, Vec<f32>), E>
where
    B: Backend,
    E: From<OpError> + From<RuntimeError>,
{
    let layer = streamer.layer();
    if x.rows() == 1 && !spec.trace {
        let missing = be.experts_to_complete(layer)?;
        if !missing.is_empty() {
            complete::<B, E>(be, streamer, &missing)?;
        }
    }
    if x.rows() == 1 && !spec.trace && be.routes_on_device(layer, spec.top_k)? {
        look_ahead(be, ahead)?;
        let (carry, mut acc) = meanwhile()?;
        be.routed_experts_held(layer, experts, act, x, logits, spec, &mut acc)?;
        return Ok((carry, acc, Vec::new()));
    }
    // A backend that computes some of a decode row's misses on the host reads the row back
    // with the routing.
    let (routes, x_host) = if x.rows() == 1 && be.splits_misses() {
        let (routes, row) = be.route_and_read(logits, spec, x)?;
        (routes, Some(row))
    } else {
        (be.route(logits, spec)?, None)
    };
    let (carry, acc) = if x.rows() == 1 {
        one_row(
            be, streamer, experts, act, x, x_host, &routes, ahead, meanwhile,
        )?
    } else {
        look_ahead(be, ahead)?;
        routed_experts(be, streamer, experts, act, x, &routes, meanwhile)?
    };
    Ok((carry, acc, routes.margins))
}

/// Loads `experts` of the streamer's layer into the backend's own cache, through the host
/// streamer in tiles of half its slots (at most 8), waiting for each tile's copies before its
/// host slots are released. (Decode completes a resident layer this way; the load fills the
/// resident layers with it, `Streamers::preload` in mference-models.)
pub fn complete<B: Backend, E>(
    be: &B,
    streamer: &mut ExpertStreamer,
    experts: &[usize],
) -> Result<(), E>
where
    E: From<OpError> + From<RuntimeError>,
{
    let layer = streamer.layer();
    be.attach_host_slots(layer, streamer.slot_memory())?;
    be.expert_copies_done()?;
    for tile in experts.chunks(host_tile(streamer.slots())) {
        let slots = streamer.acquire(tile)?;
        streamer.wait()?;
        for (&e, &(slot, _)) in tile.iter().zip(&slots) {
            be.load_expert(layer, e, streamer.blob(slot))?;
        }
        be.expert_copies_done()?;
        streamer.release(tile);
    }
    Ok(())
}

/// Reads all `experts` experts of the streamer's layer into its host slots, shown to the backend
/// first ([`DeviceExpertOps::attach_host_slots`]: a GPU backend page-locks them), so that a prompt
/// finds the layer in pinned host memory instead of reading and pinning it on first use. For a
/// backend with its own expert cache whose host tier holds every expert of the layer (the load
/// calls it, `Streamers::preload` in mference-models); nothing is copied to the backend here.
///
/// Errors: a failed read ([`RuntimeError`]), or a backend that cannot pin the slots ([`OpError`]).
pub fn fill_host<B, E>(be: &B, streamer: &mut ExpertStreamer, experts: usize) -> Result<(), E>
where
    B: Backend,
    E: From<OpError> + From<RuntimeError>,
{
    be.attach_host_slots(streamer.layer(), streamer.slot_memory())?;
    let all: Vec<usize> = (0..experts).collect();
    for tile in all.chunks(host_tile(streamer.slots())) {
        streamer.acquire(tile)?;
        streamer.wait()?;
        streamer.release(tile);
    }
    Ok(())
}

/// Runs the experts of `routes` on the rows of `x` (`[T, hidden]`) and adds each expert's output,
/// times its weight, to an accumulator.
///
/// `meanwhile` runs once the first tile's reads are in flight (the shared expert); it returns a
/// value passed through and the accumulator `[T, hidden]` the experts are added into (zeros, or
/// the shared expert's output when the family sums into it).
///
/// Tiles: one for decode (every expert of the token), otherwise half the slots (at most 8), so the
/// current and the next tile fit in the cache together ([`in_place_tiles`] where a backend
/// computing in place reads a mapped layer file). Decode stacks the token's experts
/// ([`CoreOps::glu_mlp_rows`], one call per group: held, host hits, host misses) and adds the stack
/// in expert order at the end.
///
/// Errors: a failed read or a full cache ([`RuntimeError`]), an op error ([`OpError`]).
pub fn routed_experts<B, S, E>(
    be: &B,
    streamer: &mut ExpertStreamer,
    experts: &Mlp,
    act: Act,
    x: &B::Tensor,
    routes: &Routes,
    meanwhile: impl FnOnce() -> Result<(S, B::Tensor), E>,
) -> Result<(S, B::Tensor), E>
where
    B: Backend,
    E: From<OpError> + From<RuntimeError>,
{
    if x.rows() == 1 {
        return one_row(be, streamer, experts, act, x, None, routes, None, meanwhile);
    }
    let layer = streamer.layer();
    be.attach_host_slots(layer, streamer.slot_memory())?;
    // A backend with a staging area copies this step's misses there rather than into its slots;
    // the staging ends with the step, failed or not (a failed step keeps none of it).
    if !be.begin_prefill_staging(layer)? {
        return tiles(be, streamer, experts, act, x, routes, meanwhile);
    }
    let out = tiles(be, streamer, experts, act, x, routes, meanwhile);
    let uses: Vec<(usize, u64)> = match &out {
        Ok(_) => routes
            .experts
            .iter()
            .map(|(&e, rows)| (e, rows.len() as u64))
            .collect(),
        Err(_) => Vec::new(),
    };
    let end = be.end_prefill_staging(layer, &uses);
    let out = out?;
    end?;
    Ok(out)
}

/// [`routed_experts`] of several rows: the held experts, then the host streamer's tiles.
fn tiles<B, S, E>(
    be: &B,
    streamer: &mut ExpertStreamer,
    experts: &Mlp,
    act: Act,
    x: &B::Tensor,
    routes: &Routes,
    meanwhile: impl FnOnce() -> Result<(S, B::Tensor), E>,
) -> Result<(S, B::Tensor), E>
where
    B: Backend,
    E: From<OpError> + From<RuntimeError>,
{
    let layer = streamer.layer();
    let routed: Vec<usize> = routes.experts.keys().copied().collect();
    // Experts the backend holds in its own memory (GPU slots) never reach the host streamer.
    let held = be.held_experts(layer, &routed)?;
    let needed: Vec<usize> = routed
        .iter()
        .zip(&held)
        .filter(|(_, &h)| !h)
        .map(|(&e, _)| e)
        .collect();
    // Every expert computed in place from a mapped layer file (a resident install on the CPU):
    // nothing to read or refill, so tiles as large as their rows allow, one batch of parallel
    // regions for many experts rather than one per 8 (at 16 threads a 64-token prompt's tile of
    // 8 gave each thread a few dozen rows per region). Slots of a cache keep the tiles of 8: one
    // acquire is one tick of the LRU clock, which would give a whole layer one age.
    let tiles = if be.computes_in_place() && streamer.is_mapped() {
        in_place_tiles(needed, routes)
    } else {
        prefill_tiles(needed, routes, host_tile(streamer.slots()))
    };
    // A decode step may have left copies reading host slots that these reads could refill.
    be.expert_copies_done()?;
    let mut next_slots = match tiles.first() {
        Some((first, uses)) => Some(streamer.acquire_uses(first, uses)?),
        None => None,
    };
    let (carry, mut acc) = meanwhile()?;

    let mut out: Vec<Option<B::Tensor>> = (0..=routed.last().copied().unwrap_or(0))
        .map(|_| None)
        .collect();
    // Held experts first, in one call: their bytes are in place while the host reads the rest.
    let in_place: Vec<usize> = routed
        .iter()
        .zip(&held)
        .filter(|(_, &h)| h)
        .map(|(&e, _)| e)
        .collect();
    let srcs: Vec<Weights> = in_place
        .iter()
        .map(|&expert| Weights::Held { layer, expert })
        .collect();
    run_batch(be, experts, act, x, routes, &in_place, &srcs, &mut out)?;
    // A tile's experts from their host slots, in one call (a backend with its own cache copies
    // each into it first, `load_expert`).
    let from_host = |list: &[(usize, usize)],
                     streamer: &ExpertStreamer,
                     out: &mut Vec<Option<B::Tensor>>|
     -> Result<(), OpError> {
        let es: Vec<usize> = list.iter().map(|&(e, _)| e).collect();
        let srcs = list
            .iter()
            .map(|&(e, slot)| be.load_expert(layer, e, streamer.blob(slot)))
            .collect::<OpResult<Vec<_>>>()?;
        run_batch(be, experts, act, x, routes, &es, &srcs, out)
    };
    for (ti, (tl, _)) in tiles.iter().enumerate() {
        let slots = next_slots.take().expect("tile acquired one step ahead");
        // (expert, host slot) of the tile's hits, then of its misses.
        let of = |want_hit: bool| -> Vec<(usize, usize)> {
            tl.iter()
                .zip(&slots)
                .filter(|(_, &(_, hit))| hit == want_hit)
                .map(|(&e, &(slot, _))| (e, slot))
                .collect()
        };
        // Hits are in memory already: compute them while this tile's misses are read.
        from_host(&of(true), streamer, &mut out)?;
        streamer.wait()?;
        if let Some((next, uses)) = tiles.get(ti + 1) {
            next_slots = Some(streamer.acquire_uses(next, uses)?);
        }
        from_host(&of(false), streamer, &mut out)?;
        // The host slots may be refilled once the copies out of them are done.
        be.expert_copies_done()?;
        streamer.release(tl);
    }
    let mut ys = Vec::with_capacity(routes.experts.len());
    let mut rows = Vec::with_capacity(routes.experts.len());
    for (e, r) in &routes.experts {
        ys.push(out[*e].as_ref().expect("every routed expert ran"));
        rows.push(r.as_slice());
    }
    be.scatter_add_many(&mut acc, &ys, &rows)?;
    Ok((carry, acc))
}

/// Runs the distinct experts `es` of `routes` from `srcs` on their rows of `x` in one
/// [`CoreOps::glu_mlp_experts`] call, expert `e`'s output into `out[e]` (each output the bits
/// [`CoreOps::glu_mlp`] gives for it alone).
#[allow(clippy::too_many_arguments)]
fn run_batch<B: Backend>(
    be: &B,
    experts: &Mlp,
    act: Act,
    x: &B::Tensor,
    routes: &Routes,
    es: &[usize],
    srcs: &[Weights],
    out: &mut [Option<B::Tensor>],
) -> Result<(), OpError> {
    if es.is_empty() {
        return Ok(());
    }
    let lists: Vec<Vec<usize>> = es
        .iter()
        .map(|e| routes.experts[e].iter().map(|&(r, _)| r).collect())
        .collect();
    let xs = be.gather_rows_many(x, &lists.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
    let ys = be.glu_mlp_experts(experts, act, srcs, &xs.iter().collect::<Vec<_>>())?;
    for (&e, y) in es.iter().zip(ys) {
        out[e] = Some(y);
    }
    Ok(())
}

/// The host streamer's tiles for several rows: `needed` (the routed experts the backend does not
/// hold) in tiles of `tile` experts ([`host_tile`] of the slots where reads are needed: the
/// current and the next tile fit in the cache together), each expert with its use count (the
/// rows routed to it, as decode counts one use per token). The most used experts come last, so
/// the cache the next step starts from holds them rather than the highest ids; the sum is in
/// expert order whatever the tile order.
pub fn prefill_tiles(
    needed: Vec<usize>,
    routes: &Routes,
    tile: usize,
) -> Vec<(Vec<usize>, Vec<u64>)> {
    by_uses(needed, routes)
        .chunks(tile.max(1))
        .map(|tl| tl.iter().copied().unzip())
        .collect()
}

/// `needed` with their use counts (the rows routed to each), least used first, ties by id: the
/// order of both tilings.
fn by_uses(needed: Vec<usize>, routes: &Routes) -> Vec<(usize, u64)> {
    let mut v: Vec<(usize, u64)> = needed
        .into_iter()
        .map(|e| (e, routes.experts.get(&e).map_or(0, |r| r.len() as u64)))
        .collect();
    v.sort_by_key(|&(e, u)| (u, e));
    v
}

/// Experts per host-streamer tile of several rows: half the `slots` (at most 8), so the current
/// and the next tile fit in the cache together.
pub fn host_tile(slots: usize) -> usize {
    (slots / 2).clamp(1, HOST_TILE_MAX)
}

/// The most experts in a tile the host streamer reads for.
const HOST_TILE_MAX: usize = 8;

/// Routed rows past which [`in_place_tiles`] starts a new tile once it holds 8 experts: a tile's
/// gathered rows, their prepared copies and its hidden products live together (~22 KB a row at
/// Gemma 4's sizes, so ~23 MB for a tile past 8 experts; 8 experts alone may hold more, as
/// before), where one tile of a 2048-token chunk's 16,384 routed rows would hold ~370 MB.
const IN_PLACE_TILE_ROWS: u64 = 1024;

/// [`prefill_tiles`] for experts that need no read (a mapped layer file computed in place): in
/// the same order, tiles of at least [`HOST_TILE_MAX`] experts (or what is left)
/// that close once the next expert would take their routed rows past [`IN_PLACE_TILE_ROWS`]. A
/// 64-token chunk's experts of a top-8 layer (512 rows) are one tile.
pub fn in_place_tiles(needed: Vec<usize>, routes: &Routes) -> Vec<(Vec<usize>, Vec<u64>)> {
    let mut tiles: Vec<(Vec<usize>, Vec<u64>)> = Vec::new();
    let mut rows = 0;
    for (e, u) in by_uses(needed, routes) {
        let open = tiles
            .last()
            .is_some_and(|(es, _)| es.len() < HOST_TILE_MAX || rows + u <= IN_PLACE_TILE_ROWS);
        if !open {
            tiles.push((Vec::new(), Vec::new()));
            rows = 0;
        }
        let (es, us) = tiles.last_mut().expect("a tile is open");
        es.push(e);
        us.push(u);
        rows += u;
    }
    tiles
}

/// [`routed_experts`] for one row: every expert of the token in one tile, computed into row `j`
/// of a stack (`j` = the expert's place in expert order), then added to the accumulator in that
/// order, so the sum is the same whichever group an expert was computed in. `ahead` runs once
/// this step's reads (host) or copies (a backend's own cache) are queued.
#[allow(clippy::too_many_arguments)]
fn one_row<B, S, E>(
    be: &B,
    streamer: &mut ExpertStreamer,
    experts: &Mlp,
    act: Act,
    x: &B::Tensor,
    x_host: Option<Vec<f32>>,
    routes: &Routes,
    ahead: Option<Lookahead>,
    meanwhile: impl FnOnce() -> Result<(S, B::Tensor), E>,
) -> Result<(S, B::Tensor), E>
where
    B: Backend,
    E: From<OpError> + From<RuntimeError>,
{
    let layer = streamer.layer();
    be.attach_host_slots(layer, streamer.slot_memory())?;
    let routed: Vec<usize> = routes.experts.keys().copied().collect();
    let held = be.held_experts(layer, &routed)?;
    // (row of the stack, expert) of the experts the host streamer must provide.
    let needed: Vec<(usize, usize)> = routed
        .iter()
        .enumerate()
        .zip(&held)
        .filter(|(_, &h)| !h)
        .map(|((j, &e), _)| (j, e))
        .collect();
    let ids: Vec<usize> = needed.iter().map(|&(_, e)| e).collect();
    // The backend's copies out of the host slots (this layer's earlier steps) are waited for
    // only when this step's reads could refill a slot: with every expert in a host slot the
    // copies run on while the host queues the next layers.
    if !streamer.holds(&ids) {
        be.expert_copies_done()?;
    }
    let slots = if ids.is_empty() {
        Vec::new()
    } else {
        streamer.acquire(&ids)?
    };
    // The misses the backend computes on the host CPU instead of copying them in. The row goes
    // down first, before the step queues more work behind it.
    let host_miss = if ids.is_empty() {
        Vec::new()
    } else {
        be.host_misses(layer, &ids)?
    };
    let n_host = host_miss.iter().filter(|&&h| h).count();
    let x_host = match x_host {
        Some(row) => row,
        None if n_host > 0 => be.read(x)?,
        None => Vec::new(),
    };
    let own_cache = be.device_expert_stats().is_some();
    let mut ahead = ahead;
    if !own_cache {
        // This step's reads are queued: the predicted ones go behind them.
        look_ahead(be, ahead.take())?;
    }
    let (carry, mut acc) = meanwhile()?;
    let weights: Vec<f32> = routed
        .iter()
        .map(|e| routes.experts[e].first().map_or(0.0, |&(_, w)| w))
        .collect();
    if own_cache {
        // A backend with its own expert cache copies the misses in asynchronously: every expert
        // is placed first, then the row's experts run in one call (two launches on a GPU), the
        // same sums in the same order as the groups below.
        if !ids.is_empty() {
            streamer.wait()?;
        }
        let mut from_host = needed.iter().zip(&slots).enumerate();
        let mut srcs = Vec::with_capacity(routed.len());
        let mut on_host = vec![false; routed.len()];
        for (j, (&e, &h)) in routed.iter().zip(&held).enumerate() {
            srcs.push(if h {
                Weights::Held { layer, expert: e }
            } else {
                let (i, (_, &(slot, _))) =
                    from_host.next().expect("one host slot per needed expert");
                if host_miss[i] {
                    on_host[j] = true;
                    Weights::Blob(streamer.blob(slot))
                } else {
                    be.load_expert(layer, e, streamer.blob(slot))?
                }
            });
        }
        // This step's copies are queued: the predicted ones go behind them.
        look_ahead(be, ahead)?;
        if n_host > 0 {
            be.glu_mlp_combine_split(
                experts, act, &srcs, &weights, &on_host, x, &x_host, &mut acc,
            )?;
        } else {
            be.glu_mlp_combine(experts, act, &srcs, &weights, x, &mut acc)?;
        }
        drop(srcs);
        if !ids.is_empty() {
            streamer.release(&ids);
        }
        return Ok((carry, acc));
    }
    let mut stack = be.zeros(routed.len().max(1), acc.cols())?;

    // Held experts first: their bytes are in place while the host reads the rest.
    let (rows, srcs): (Vec<usize>, Vec<Weights>) = routed
        .iter()
        .enumerate()
        .zip(&held)
        .filter(|(_, &h)| h)
        .map(|((j, &e), _)| (j, Weights::Held { layer, expert: e }))
        .unzip();
    be.glu_mlp_rows(experts, act, &srcs, x, &mut stack, &rows)?;
    if !ids.is_empty() {
        // Host hits are in memory already: compute them while the misses are read.
        for want_hit in [true, false] {
            if !want_hit {
                streamer.wait()?;
            }
            let mut rows = Vec::new();
            let mut srcs = Vec::new();
            for (&(j, e), &(slot, hit)) in needed.iter().zip(&slots) {
                if hit == want_hit {
                    rows.push(j);
                    srcs.push(be.load_expert(layer, e, streamer.blob(slot))?);
                }
            }
            be.glu_mlp_rows(experts, act, &srcs, x, &mut stack, &rows)?;
        }
        // Released with their copies possibly still in flight: a later read into one of these
        // slots waits for them first (above, and before every prefill tile).
        streamer.release(&ids);
    }
    let pairs: Vec<(usize, f32)> = weights.iter().map(|&w| (0, w)).collect();
    if !pairs.is_empty() {
        be.scatter_add(&mut acc, &stack, &pairs)?;
    }
    Ok((carry, acc))
}

/// Starts what `ahead` asks for: for a backend with its own expert cache, of the `n` heaviest
/// predicted experts, copies of those that sit in the next layer's host slots and not in the
/// backend's ([`ExpertStreamer::landed_blob`], [`DeviceExpertOps::prefetch_expert`]; nothing is
/// read from the file; an expert held already still counts among the `n`), otherwise reads into
/// those host slots of the `n` heaviest not cached there ([`prefetch_predicted`]). Returns the
/// copies or reads started.
fn look_ahead<B: Backend>(be: &B, ahead: Option<Lookahead>) -> OpResult<usize> {
    let Some(a) = ahead else {
        return Ok(0);
    };
    if be.device_expert_stats().is_none() {
        return Ok(prefetch_predicted(a.next, a.predicted, a.n));
    }
    let layer = a.next.layer();
    be.attach_host_slots(layer, a.next.slot_memory())?;
    let mut started = 0;
    for e in heaviest(a.predicted, |_| true).into_iter().take(a.n) {
        if let Some(blob) = a.next.landed_blob(e) {
            started += usize::from(be.prefetch_expert(layer, e, blob)?);
        }
    }
    Ok(started)
}

/// The experts of one predicted row that `keep` keeps, heaviest first (ties: lower id first).
fn heaviest(predicted: &Routes, keep: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut ranked: Vec<(usize, f32)> = predicted
        .experts
        .iter()
        .filter(|(&e, _)| keep(e))
        .map(|(&e, rows)| (e, rows.first().map_or(0.0, |&(_, w)| w)))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.into_iter().map(|(e, _)| e).collect()
}

/// Router lookahead (`docs/ARCHITECTURE.md`, "Reads ahead of the router"):
/// starts reads, in the next layer's streamer `next`, of the `n` heaviest experts of `predicted`
/// that it does not hold yet. `predicted` is the next layer's router applied to this layer's
/// post-attention state, one row (decode); its weights rank the experts (ties: lower id first).
///
/// Never blocks and never pins: the reads go to the shared I/O queue behind the demand reads
/// already submitted, a misprediction only costs its slot and its read, and the next layer joins a
/// read only when its router really picks that expert ([`ExpertStreamer::acquire`]). The slots of
/// the current layer are not touched, so nothing the current token still needs is evicted. The
/// cached bytes are the file's either way, so results are identical with and without it. Returns
/// the number of reads started.
fn prefetch_predicted(next: &mut ExpertStreamer, predicted: &Routes, n: usize) -> usize {
    let ids: Vec<usize> = heaviest(predicted, |e| !next.cached(e))
        .into_iter()
        .take(n)
        .collect();
    if ids.is_empty() {
        return 0;
    }
    next.prefetch(&ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(rows_of: &[(usize, usize)]) -> Routes {
        let mut r = Routes::default();
        for &(e, n) in rows_of {
            r.experts.insert(e, (0..n).map(|i| (i, 1.0)).collect());
        }
        r
    }

    #[test]
    fn in_place_tiles_keep_the_order_and_bound_their_rows() {
        // 128 experts of 4 rows (a 64-token chunk, top 8): one tile, least used first.
        let r = routes(&(0..128).map(|e| (e, 4)).collect::<Vec<_>>());
        let t = in_place_tiles(r.experts.keys().copied().collect(), &r);
        assert_eq!(t.len(), 1);
        assert_eq!(
            t,
            prefill_tiles(r.experts.keys().copied().collect(), &r, 128)
        );
        // 128 experts of 1 to 64 rows: every expert once, in prefill_tiles' order; a tile past
        // the row bound only where it holds no more than HOST_TILE_MAX experts.
        let r = routes(&(0..128).map(|e| (e, 1 + (e * 37) % 64)).collect::<Vec<_>>());
        let needed: Vec<usize> = r.experts.keys().copied().collect();
        let t = in_place_tiles(needed.clone(), &r);
        let flat: Vec<usize> = t.iter().flat_map(|(es, _)| es.clone()).collect();
        let order: Vec<usize> = prefill_tiles(needed, &r, 1)
            .into_iter()
            .map(|(es, _)| es[0])
            .collect();
        assert_eq!(flat, order);
        assert!(t.len() > 1);
        for (es, us) in &t {
            assert_eq!(es.len(), us.len());
            let rows: u64 = us.iter().sum();
            assert!(
                es.len() <= HOST_TILE_MAX || rows <= IN_PLACE_TILE_ROWS,
                "{rows} rows in {}",
                es.len()
            );
            assert!(
                es.len() >= HOST_TILE_MAX || (es, us) == t.last().map(|(a, b)| (a, b)).unwrap()
            );
        }
    }
}
