//! The slot table of one layer's expert cache: which expert each slot holds, and which slot to
//! give up next. One policy for every tier (`docs/ARCHITECTURE.md`): the host streamer's
//! slots ([`crate::ExpertStreamer`]) and a GPU backend's device slots.
//!
//! Policy: a free slot first, otherwise the unpinned slot whose expert has the lowest use count
//! over the whole session (LFU), the least recently used among equals; or, with
//! [`Eviction::Lru`], the least recently used one. Among exact equals, the lowest slot.

/// Which unpinned slot a full table gives up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Eviction {
    /// Lowest use count over the session, least recent among equals (the default everywhere).
    #[default]
    Lfu,
    /// Least recently used (use counts ignored).
    Lru,
}

/// Expert ↔ slot maps with LFU + recency counters, for `experts` experts in `slots` slots.
#[derive(Clone, Debug)]
pub struct SlotTable {
    eviction: Eviction,
    /// expert → slot, -1 when absent.
    slot_of: Vec<i32>,
    /// slot → expert, -1 when free.
    expert_in: Vec<i32>,
    pinned: Vec<bool>,
    use_count: Vec<u64>,
    last_used: Vec<u64>,
    clock: u64,
}

impl SlotTable {
    /// An empty LFU table. `slots` is at most `experts` in practice (callers clamp it).
    pub fn new(experts: usize, slots: usize) -> Self {
        Self::with_eviction(experts, slots, Eviction::Lfu)
    }

    /// An empty table that evicts by `eviction`.
    pub fn with_eviction(experts: usize, slots: usize, eviction: Eviction) -> Self {
        Self {
            eviction,
            slot_of: vec![-1; experts],
            expert_in: vec![-1; slots],
            pinned: vec![false; slots],
            use_count: vec![0; experts],
            last_used: vec![0; experts],
            clock: 0,
        }
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.expert_in.len()
    }

    /// Number of experts the table can name.
    pub fn experts(&self) -> usize {
        self.slot_of.len()
    }

    /// The slot holding expert `e`, if any.
    pub fn slot_of(&self, e: usize) -> Option<usize> {
        usize::try_from(self.slot_of[e]).ok()
    }

    /// The expert held in `slot`, if any.
    pub fn expert_in(&self, slot: usize) -> Option<usize> {
        usize::try_from(self.expert_in[slot]).ok()
    }

    /// Starts a new request: the uses [`touch`](Self::touch) counts next share one time step.
    pub fn tick(&mut self) {
        self.clock += 1;
    }

    /// Counts one use of expert `e` at the current time step.
    pub fn touch(&mut self, e: usize) {
        self.touch_uses(e, 1);
    }

    /// Counts `uses` uses of expert `e` at the current time step: a prefill tile counts each row
    /// routed to `e`, as decode counts each token, so the counts mean the same in both.
    pub fn touch_uses(&mut self, e: usize, uses: u64) {
        self.use_count[e] += uses;
        self.last_used[e] = self.clock;
    }

    /// The uses of expert `e` counted so far (and when it was last used), as eviction ranks them.
    pub fn uses(&self, e: usize) -> (u64, u64) {
        (self.use_count[e], self.last_used[e])
    }

    /// Whether `slot` may not be given up.
    pub fn is_pinned(&self, slot: usize) -> bool {
        self.pinned[slot]
    }

    /// Pins or unpins `slot`.
    pub fn set_pinned(&mut self, slot: usize, pinned: bool) {
        self.pinned[slot] = pinned;
    }

    /// The slot to fill next: a free one, else the unpinned slot (among those `usable` allows)
    /// whose expert has the lowest use count, the least recently used among equals (LFU), or the
    /// least recently used one (LRU); the lowest such slot among exact equals.
    pub fn victim(&self, usable: impl Fn(usize) -> bool) -> Option<usize> {
        if let Some(s) = self.expert_in.iter().position(|&e| e < 0) {
            return Some(s);
        }
        let count = |e: usize| match self.eviction {
            Eviction::Lfu => self.use_count[e],
            Eviction::Lru => 0,
        };
        (0..self.expert_in.len())
            .filter(|&s| !self.pinned[s] && usable(s))
            .min_by_key(|&s| {
                let e = self.expert_in[s] as usize;
                (count(e), self.last_used[e])
            })
    }

    /// Puts expert `e` in `slot`, evicting the expert the slot held.
    pub fn assign(&mut self, slot: usize, e: usize) {
        if let Some(old) = self.expert_in(slot) {
            self.slot_of[old] = -1;
        }
        self.expert_in[slot] = e as i32;
        self.slot_of[e] = slot as i32;
    }

    /// Empties the slot holding expert `e` (a failed read), unpinning it.
    pub fn forget(&mut self, e: usize) {
        if let Some(s) = self.slot_of(e) {
            self.expert_in[s] = -1;
            self.pinned[s] = false;
            self.slot_of[e] = -1;
        }
    }
}

/// How many experts of a layer may be cached at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheSlots {
    /// N slots per layer (8, 16, 24, 32, 64, 96 or 128).
    Fixed(usize),
    /// One slot per expert: after warm-up every expert stays in memory. Without O_DIRECT the layer file
    /// is mapped instead of copied into a slab, so the page cache holds the only copy.
    Resident,
}

impl CacheSlots {
    /// Slot counts accepted on the command line.
    pub const ALLOWED: [usize; 7] = [8, 16, 24, 32, 64, 96, 128];

    /// Parses `8|16|24|32|64|96|128|resident`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "resident" {
            return Ok(Self::Resident);
        }
        match s.parse::<usize>() {
            Ok(n) if Self::ALLOWED.contains(&n) => Ok(Self::Fixed(n)),
            _ => Err(format!("invalid expert cache slots '{s}': allowed values are 8, 16, 24, 32, 64, 96, 128, resident")),
        }
    }

    /// Number of slots for a layer with `experts` experts (never more than `experts`).
    pub fn count(self, experts: usize) -> usize {
        match self {
            Self::Fixed(n) => n.min(experts),
            Self::Resident => experts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_slots_first_then_least_frequent_then_least_recent() {
        let mut t = SlotTable::new(8, 3);
        for e in [0, 1, 2] {
            t.tick();
            t.touch(e);
            let s = t.victim(|_| true).expect("a free slot");
            t.assign(s, e);
        }
        // 0 used again: 1 and 2 tie on count; 1 is older.
        t.tick();
        t.touch(0);
        assert_eq!(t.victim(|_| true), t.slot_of(1));
        // Pinned or unusable slots are skipped.
        t.set_pinned(t.slot_of(1).unwrap(), true);
        assert_eq!(t.victim(|_| true), t.slot_of(2));
        let s2 = t.slot_of(2).unwrap();
        assert_eq!(t.victim(|s| s != s2), t.slot_of(0));
        // Evicting moves the expert out of the maps.
        t.assign(s2, 5);
        assert_eq!(t.slot_of(2), None);
        assert_eq!(t.expert_in(s2), Some(5));
        t.forget(5);
        assert_eq!(t.expert_in(s2), None);
        assert_eq!(
            t.victim(|_| false),
            Some(s2),
            "a free slot needs no permission"
        );
    }

    #[test]
    fn lru_ignores_use_counts() {
        let mut t = SlotTable::with_eviction(8, 2, Eviction::Lru);
        for e in [0, 0, 0, 1] {
            t.tick();
            t.touch(e);
            if t.slot_of(e).is_none() {
                let s = t.victim(|_| true).unwrap();
                t.assign(s, e);
            }
        }
        // 0 is the most used but the least recent: LRU gives it up, LFU would not.
        assert_eq!(t.victim(|_| true), t.slot_of(0));
    }
}
