//! Copying the plan's ranges while each source shard is read once, front to back, through a
//! [`FileHasher`]: the bytes between ranges (the safetensors header, tensors left out) are read
//! and hashed, not written, so every byte of the shard is checked against the digest the source
//! publishes. A shard is recorded as verified in the journal only once its digest matched; a
//! resume reads again every shard not recorded, re-hashing the ranges written before (and
//! rewriting any whose bytes the source now serves differently).

use crate::copy::{run_range, Dests};
use crate::journal::{CompletedRange, Journal};
use crate::plan::{Plan, TILE_BYTES};
use crate::progress::Progress;
use crate::source::{read_error, Source};
use crate::verify::{FileHasher, HashingReader, Published, SourceCheck};
use crate::InstallError;
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

/// What streaming the shards did.
#[derive(Default)]
pub struct Streamed {
    /// One per shard, in [`Plan::shard_files`] order.
    pub checks: Vec<SourceCheck>,
    /// Ranges written by this run and their source bytes.
    pub ranges_fetched: usize,
    /// Of those, ranges journaled by an earlier run that the source now served differently.
    pub ranges_rewritten: usize,
    pub fetched_bytes: u64,
    /// Source bytes read only to be hashed: headers, tensors left out, gaps between ranges, and
    /// ranges written by an earlier run.
    pub hashed_only_bytes: u64,
}

/// Everything [`copy_shards`] works on.
pub struct Job<'a> {
    pub source: &'a dyn Source,
    pub plan: &'a Plan,
    /// Size of each shard, bytes ([`Plan::shard_files`] order).
    pub shard_sizes: &'a [u64],
    /// The digest each shard must match (`None`: the source published none and that was allowed).
    pub expected: &'a [Option<Published>],
    pub dests: &'a Dests,
    /// Ranges whose destinations already hold their journaled bytes.
    pub done: &'a [bool],
    pub journal_path: &'a Path,
}

/// Stream every shard not yet verified, writing the ranges not `done` and journaling each as it
/// completes. Errors: read and write failures; [`InstallError::SourceDigestMismatch`] for a shard
/// whose bytes do not match, after its ranges are dropped from the journal.
pub fn copy_shards(
    job: &Job,
    journal: &mut Journal,
    progress: &mut Progress,
) -> Result<Streamed, InstallError> {
    let plan = job.plan;
    let mut out = Streamed::default();
    let mut tile = vec![0u8; TILE_BYTES];
    let journaled: HashMap<String, String> = journal
        .completed_ranges
        .iter()
        .map(|c| (c.id.clone(), c.destination_digest.clone()))
        .collect();
    let mut todo = Vec::new();
    for (s, file) in plan.shard_files.iter().enumerate() {
        let ranges: Vec<usize> = (0..plan.ranges.len())
            .filter(|&i| plan.ranges[i].shard == s)
            .collect();
        let expected = job.expected[s].as_ref().map(Published::describe);
        match journal.verified_source_files.get(file) {
            Some(v)
                if ranges.iter().all(|&i| job.done[i])
                    && v.verified_against == expected
                    && v.size == job.shard_sizes[s] =>
            {
                out.checks.push(SourceCheck {
                    file: file.clone(),
                    size: v.size,
                    sha256: v.sha256.clone(),
                    against: job.expected[s].clone(),
                });
            }
            _ => todo.push((s, ranges)),
        }
    }
    let total: u64 = todo.iter().map(|(s, _)| job.shard_sizes[*s]).sum();
    progress.stage(&format!(
        "copying from {} shard(s) ({total} bytes read and hashed, {} already verified)",
        todo.len(),
        plan.shard_files.len() - todo.len()
    ));
    progress.start_bytes(total, 0);
    for (s, ranges) in todo {
        let file = &plan.shard_files[s];
        let mut hasher = FileHasher::new(file, job.shard_sizes[s], job.expected[s].clone());
        for &i in &ranges {
            let r = &plan.ranges[i];
            out.hashed_only_bytes +=
                hash_span(job, file, r.start, &mut hasher, &mut tile, progress)?;
            let mut reader = job.source.open_range(file, r.start, r.end)?;
            let mut tee = HashingReader {
                inner: &mut *reader,
                hasher: &mut hasher,
            };
            let mut on_bytes = |n| progress.inc(n);
            let before = job.done[i].then(|| journaled.get(&r.id)).flatten();
            let digest = run_range(
                r,
                &plan.copies,
                &mut tee,
                job.dests,
                before.is_none(),
                &mut tile,
                &mut on_bytes,
            )?;
            match before {
                Some(d) if *d == digest => {
                    out.hashed_only_bytes += r.end - r.start;
                    continue;
                }
                Some(_) => {
                    // The source now serves other bytes for this range than those written before:
                    // write what it serves now (the shard's digest decides which was right).
                    let mut again = job.source.open_range(file, r.start, r.end)?;
                    let d = run_range(
                        r,
                        &plan.copies,
                        &mut *again,
                        job.dests,
                        true,
                        &mut tile,
                        &mut |_| {},
                    )?;
                    if d != digest {
                        return Err(InstallError::SourceInvalid {
                            detail: format!(
                                "{file}: bytes {}..{} differ between two reads",
                                r.start, r.end
                            ),
                        });
                    }
                    journal.completed_ranges.retain(|c| c.id != r.id);
                    out.ranges_rewritten += 1;
                }
                None => {}
            }
            journal.completed_ranges.push(CompletedRange {
                id: r.id.clone(),
                destination_digest: digest,
                source_bytes: r.end - r.start,
                destination_bytes: plan.copies[r.copies.clone()]
                    .iter()
                    .map(|c| c.dst_len())
                    .sum(),
            });
            journal.store(job.journal_path)?;
            out.ranges_fetched += 1;
            out.fetched_bytes += r.end - r.start;
        }
        out.hashed_only_bytes += hash_span(
            job,
            file,
            job.shard_sizes[s],
            &mut hasher,
            &mut tile,
            progress,
        )?;
        match hasher.finish() {
            Ok(check) => {
                journal
                    .verified_source_files
                    .insert(file.clone(), check.record());
                journal.store(job.journal_path)?;
                out.checks.push(check);
            }
            Err(e) => {
                // Nothing of this shard stays journaled: a resume fetches all of it again.
                let ids: Vec<&str> = ranges.iter().map(|&i| plan.ranges[i].id.as_str()).collect();
                journal
                    .completed_ranges
                    .retain(|c| !ids.contains(&c.id.as_str()));
                journal.store(job.journal_path)?;
                progress.finish();
                return Err(e);
            }
        }
    }
    progress.finish();
    Ok(out)
}

/// Read and hash `file` from the hasher's position up to `end`, writing nothing; returns the
/// bytes read.
fn hash_span(
    job: &Job,
    file: &str,
    end: u64,
    hasher: &mut FileHasher,
    tile: &mut [u8],
    progress: &Progress,
) -> Result<u64, InstallError> {
    let start = hasher.position();
    if start >= end {
        return Ok(0);
    }
    let mut r = job.source.open_range(file, start, end)?;
    let mut left = end - start;
    while left > 0 {
        let n = (left as usize).min(tile.len());
        r.read_exact(&mut tile[..n]).map_err(|e| {
            read_error(
                file,
                &format!("read failed at byte {}", hasher.position()),
                e,
            )
        })?;
        hasher.update(&tile[..n]);
        progress.inc(n as u64);
        left -= n as u64;
    }
    Ok(end - start)
}
