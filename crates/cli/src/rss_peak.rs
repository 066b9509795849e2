//! Peak resident memory split into anonymous and file-backed pages, for `mference bench`.
//!
//! `VmHWM` (the kernel's peak resident set) has no split, and `RssAnon` / `RssFile` in
//! `/proc/self/status` are only the current values. [`PeakSampler`] reads them on a background
//! thread every `period` and whenever [`PeakSampler::sample_now`] is called (the bench calls it at
//! the end of load, prefill and decode), keeping the largest value of each. The two peaks need not
//! come from the same moment: under a memory cap the kernel may drop mapped file pages while
//! anonymous memory grows. Sampling can miss a peak shorter than `period`; `VmHWM` cannot, so it is
//! reported beside them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// One reading of `/proc/self/status`, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rss {
    /// `RssAnon`: anonymous pages (slots, KV cache, buffers, heap).
    pub anon: u64,
    /// `RssFile`: mapped file pages (the resident weights, mapped layer files, the binary).
    pub file: u64,
    /// `RssShmem`: shared memory pages.
    pub shmem: u64,
}

/// The largest values seen, bytes, and how many samples they come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peaks {
    pub anon: u64,
    pub file: u64,
    /// The largest `anon + file + shmem` of one sample (at most `VmHWM`).
    pub total: u64,
    pub samples: u64,
}

impl Peaks {
    fn add(&mut self, r: Rss) {
        self.anon = self.anon.max(r.anon);
        self.file = self.file.max(r.file);
        self.total = self.total.max(r.anon + r.file + r.shmem);
        self.samples += 1;
    }
}

/// Parses the `RssAnon`, `RssFile` and `RssShmem` lines (in kB) of a `/proc/<pid>/status` text;
/// `None` if `RssAnon` or `RssFile` is missing (kernels before 4.5).
pub fn parse_status(status: &str) -> Option<Rss> {
    let field = |key: &str| -> Option<u64> {
        let line = status
            .lines()
            .find(|l| l.strip_prefix(key).is_some_and(|r| r.starts_with(':')))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some(Rss {
        anon: field("RssAnon")?,
        file: field("RssFile")?,
        shmem: field("RssShmem").unwrap_or(0),
    })
}

/// The current split of this process, or `None` where `/proc/self/status` has none.
pub fn current() -> Option<Rss> {
    parse_status(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// Samples [`current`] on a background thread until [`PeakSampler::finish`].
pub struct PeakSampler {
    peaks: Arc<Mutex<Peaks>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PeakSampler {
    /// Takes one sample now and then one every `period`.
    pub fn start(period: Duration) -> Self {
        let peaks = Arc::new(Mutex::new(Peaks::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let s = Self {
            peaks: Arc::clone(&peaks),
            stop: Arc::clone(&stop),
            thread: None,
        };
        s.sample_now();
        let thread = std::thread::Builder::new()
            .name("mference-rss".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::park_timeout(period);
                    if let Some(r) = current() {
                        peaks.lock().expect("rss peaks poisoned").add(r);
                    }
                }
            })
            .expect("spawn rss sampler");
        Self {
            thread: Some(thread),
            ..s
        }
    }

    /// Takes one sample on the calling thread.
    pub fn sample_now(&self) {
        if let Some(r) = current() {
            self.peaks.lock().expect("rss peaks poisoned").add(r);
        }
    }

    /// Takes a last sample, stops the thread and returns the peaks.
    pub fn finish(mut self) -> Peaks {
        self.sample_now();
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            t.join().expect("rss sampler panicked");
        }
        *self.peaks.lock().expect("rss peaks poisoned")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const MIB: u64 = 1 << 20;

    #[test]
    fn parses_the_kernel_status_fields_in_bytes() {
        let s = "Name:\tx\nVmHWM:\t  9000 kB\nRssAnon:\t  1024 kB\nRssFile:\t   512 kB\nRssShmem:\t     4 kB\n";
        assert_eq!(
            parse_status(s),
            Some(Rss {
                anon: 1024 * 1024,
                file: 512 * 1024,
                shmem: 4096
            })
        );
        // A prefix of another key is not the key; a missing field is None, not 0.
        assert_eq!(parse_status("RssAnonX:\t1 kB\nRssFile:\t2 kB\n"), None);
        assert_eq!(parse_status("RssAnon:\t1 kB\n"), None);
    }

    /// Touches `bytes` of fresh anonymous memory and of a mapped file, one after the other, and
    /// checks that each peak saw its own growth although the two never coincide.
    #[test]
    fn keeps_the_anonymous_and_file_peaks_apart() {
        // A period longer than the test: only the explicit samples count.
        let s = PeakSampler::start(Duration::from_secs(3600));
        let base = current().expect("this kernel reports RssAnon / RssFile");
        let bytes = 64 * MIB as usize;

        // A mapping of its own, not the heap: the allocator (mimalloc) may keep freed memory.
        let mut anon = memmap2::MmapMut::map_anon(bytes).unwrap();
        for i in (0..bytes).step_by(4096) {
            anon[i] = 1;
        }
        std::hint::black_box(&anon[..]);
        s.sample_now();
        drop(anon);

        let mut f = tempfile::tempfile().unwrap();
        let chunk = vec![7u8; MIB as usize]; // not 64 MiB of heap the allocator may keep
        for _ in 0..bytes / MIB as usize {
            f.write_all(&chunk).unwrap();
        }
        // SAFETY: a private temporary file nobody else writes while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&f).unwrap() };
        let mut sum = 0u64;
        for i in (0..bytes).step_by(4096) {
            sum += map[i] as u64;
        }
        assert_eq!(sum, 7 * (bytes as u64 / 4096));
        s.sample_now();
        let during_file = current().unwrap();
        drop(map);

        let p = s.finish();
        assert!(p.samples >= 4, "{p:?}");
        assert!(
            p.anon >= base.anon + 60 * MIB,
            "anon peak {p:?} from {base:?}"
        );
        assert!(
            p.file >= base.file + 60 * MIB,
            "file peak {p:?} from {base:?}"
        );
        // The anonymous 64 MiB were gone while the file was mapped, so no single sample holds
        // both: the total peak is below the sum of the two peaks.
        assert!(
            during_file.anon < base.anon + 32 * MIB,
            "{during_file:?} {base:?}"
        );
        assert!(p.total < p.anon + p.file, "{p:?}");
    }
}
