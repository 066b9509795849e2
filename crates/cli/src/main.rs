//! `mference`: argument parsing and exit codes only. Each subcommand lives in its own module.
// The bench JSON record is one `json!` literal with more fields than the default macro depth.
#![recursion_limit = "256"]

use crate::notes::say;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod bench_cmd;
mod chat;
mod flags;
mod install_cmd;
mod line_input;
mod load_options;
mod logits_cmd;
mod notes;
mod perplexity_cmd;
mod rss_peak;
mod run_cmd;
mod serve_cmd;

#[derive(Parser)]
#[command(
    name = "mference",
    version,
    about = "Run Mixture-of-Experts models larger than memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install a checkpoint (local MLX directory or pinned Hugging Face preset) as a .gturbo directory.
    Install(install_cmd::InstallArgs),
    /// Rehash every file of an install and rewrite its receipt.
    Verify(install_cmd::VerifyArgs),
    /// Print the family, architecture, sizes and partial-install state of an install.
    Inspect(install_cmd::InspectArgs),
    /// Remove a saved partial install and its journal.
    Discard(install_cmd::DiscardArgs),
    /// Generate text from a prompt, a messages file, or an interactive chat.
    Run(run_cmd::RunArgs),
    /// Float32 logits [T, vocab] of a JSON list of token ids, as a NumPy .npy (no tokenizer needed).
    Logits(logits_cmd::LogitsArgs),
    /// Perplexity of a text file, computed as llama-perplexity does.
    Perplexity(perplexity_cmd::PerplexityArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve_cmd::ServeArgs),
    /// Benchmark fixed prompts (short, medium, long), each in a fresh process: table and JSON.
    Bench(bench_cmd::BenchArgs),
}

/// mimalloc instead of glibc's malloc: building the tokenizer makes ~1.5 million small
/// allocations (vocabulary strings, merge pairs, hash tables) on the way to the first token.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's index of its `purge_delay` option (`mi_option_e` in mimalloc 3's
/// include/mimalloc.h; libmimalloc-sys names no constant for it). Its default there is 1,000 ms.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory in the process for reuse instead of handing it back to the kernel: a prompt
/// chunk's buffers (tens of MB a layer at 512 tokens) were returned and faulted in again, each
/// page zeroed by the kernel on the thread that touched it, mostly the main thread while the rest
/// waited. Full-size Gemma 4 26B, 2 threads (`perf stat`, one 512-token prompt): 60,030 page
/// faults -> 6,464 (the load alone ~5,600); `mference bench` alternating three rounds, prefill 512
/// 60.8 / 64.2 / 62.3 -> 67.4 / 67.6 / 68.4 tok/s, peak anonymous memory +25-37 MiB. As
/// llama.cpp allocates its compute buffers once: the peak is the same, nothing is returned before
/// exit (a server holds its largest request's buffers; under a memory cgroup they stay charged).
/// Left alone when `MIMALLOC_PURGE_DELAY` is set (the user's choice) or the option's default is
/// not the one expected (another mimalloc).
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: calls of the allocator's option API, thread-safe by its contract.
    unsafe {
        if libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) == 1000 {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        }
    }
}

/// The command line, each subcommand's usage line fixed to the one its `--help` prints. Left to
/// itself, clap's usage under an error lists every flag given as if it were required (`mference
/// run --model <MODEL> --prompt <PROMPT> --max-new <MAX_NEW>` for a missing --model).
fn command() -> clap::Command {
    let mut cmd = Cli::command();
    cmd.build();
    cmd.mut_subcommands(|mut sub| {
        // "Usage: LINE" with its styles; the title ends at the first space.
        let usage = sub.render_usage().ansi().to_string();
        match usage.split_once(' ') {
            Some((_, line)) => sub.override_usage(line.to_string()),
            None => sub,
        }
    })
}

fn main() -> std::process::ExitCode {
    keep_freed_memory();
    let mut cmd = command();
    let cli =
        Cli::from_arg_matches(&cmd.get_matches_mut()).unwrap_or_else(|e| e.format(&mut cmd).exit());
    let result = match cli.command {
        Command::Install(a) => install_cmd::install(a),
        Command::Verify(a) => install_cmd::verify(a),
        Command::Inspect(a) => install_cmd::inspect(a),
        Command::Discard(a) => install_cmd::discard(a),
        Command::Run(a) => run_cmd::run(a),
        Command::Logits(a) => logits_cmd::logits(a),
        Command::Perplexity(a) => perplexity_cmd::perplexity(a),
        Command::Serve(a) => serve_cmd::serve(a),
        Command::Bench(a) => bench_cmd::bench(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // A closed stdout (`| head`) is the reader's choice, not a failure to report.
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                return std::process::ExitCode::SUCCESS;
            }
            say!("error: {}", error_text(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes joined by ": ", skipping a cause whose text the previous message
/// already includes (typed errors often embed their source in their own message).
fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    /// The index is mimalloc's `purge_delay`: its documented default, then the value set.
    #[test]
    fn freed_memory_is_kept() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            eprintln!("MIMALLOC_PURGE_DELAY is set: the option is the user's, not checked");
            return;
        }
        // SAFETY: the allocator's option API.
        let get = || unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        assert_eq!(get(), 1000, "mimalloc's purge_delay default");
        super::keep_freed_memory();
        assert_eq!(get(), -1);
    }
}
