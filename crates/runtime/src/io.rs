//! The reader threads every layer's expert streamer shares ([`crate::streamer`]): `pread`s of
//! expert blobs into their slots, in batches a streamer waits for.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

/// Completion state of one batch of reads.
pub(crate) struct Batch {
    pub(crate) remaining: Mutex<usize>,
    pub(crate) done: Condvar,
    pub(crate) error: Mutex<Option<(usize, std::io::Error)>>,
}

/// One read: `len` bytes of `file` at `offset` into the slot at address `dst`.
pub(crate) struct Job {
    pub(crate) file: Arc<File>,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    pub(crate) dst: usize,
    pub(crate) expert: usize,
    pub(crate) batch: Arc<Batch>,
}

/// A small pool of I/O threads shared by every layer's streamer.
pub struct IoPool {
    tx: Mutex<mpsc::Sender<Job>>,
}

impl IoPool {
    /// Starts `threads` reader threads (at least one).
    pub fn new(threads: usize) -> Arc<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("mference-io-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock().expect("io queue poisoned").recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    };
                    // SAFETY: the streamer pins the destination slot until `wait` observes this batch
                    // complete, no other read targets the same slot, and the slab outlives the batch
                    // (the streamer waits for outstanding reads before dropping it).
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(job.dst as *mut u8, job.len) };
                    let result = job.file.read_exact_at(dst, job.offset);
                    if let Err(e) = result {
                        *job.batch.error.lock().expect("io error poisoned") = Some((job.expert, e));
                    }
                    let mut left = job.batch.remaining.lock().expect("io batch poisoned");
                    *left -= 1;
                    if *left == 0 {
                        job.batch.done.notify_all();
                    }
                })
                .expect("spawn io thread");
        }
        Arc::new(Self { tx: Mutex::new(tx) })
    }

    pub(crate) fn submit(&self, job: Job) {
        self.tx
            .lock()
            .expect("io queue poisoned")
            .send(job)
            .expect("io threads alive");
    }
}
