//! `run --chat`: the interactive loop, its slash commands and Ctrl-C.

use crate::notes::say;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use mference_session::{Reasoning, Session, TextSide};

use crate::line_input::{Input, Line};
use crate::run_cmd::{render, reply, RunArgs, Think};

const COMMANDS: &str = "/clear, /history, /think on|off or /quit";

/// Refuses `--think` (or `/think`) on an install whose chat template has no `enable_thinking`.
pub(crate) fn check_think(text: &TextSide, think: Think) -> Result<()> {
    match &text.template {
        None => bail!("this install has no chat template; use --prompt"),
        Some(t) => match t.check_extra(&think.kwargs()) {
            Ok(()) => Ok(()),
            Err(e) => bail!("--think: {e}"),
        },
    }
}

/// Interactive chat: the whole conversation is re-rendered each turn, and only what the model
/// does not hold yet (the new messages) is prefilled, as `serve` does.
pub(crate) fn chat(session: &mut Session, a: &RunArgs) -> Result<()> {
    let text = Arc::clone(session.text());
    let interrupt = Interrupt::install()?;
    let system =
        (!a.system.is_empty()).then(|| json!({"role": "system", "content": a.system.join("\n")}));
    let mut turns: Vec<Value> = Vec::new();
    let mut think = a.think;
    let mut input = Input::new()?;
    loop {
        let line = match input.read("> ")? {
            Line::Text(line) => line,
            Line::NotUtf8 => {
                say!("[that line is not valid UTF-8 text; nothing was sent, type it again]");
                continue;
            }
            Line::Eof => {
                say!(); // leave the terminal on a fresh line
                return Ok(());
            }
            Line::Interrupted => {
                say!();
                std::process::exit(130);
            }
        };
        match line.trim() {
            "" => continue,
            "/quit" | "/exit" => return Ok(()),
            "/clear" => {
                turns.clear();
                session.clear();
                say!("[conversation cleared]");
                continue;
            }
            "/history" => {
                for m in system.iter().chain(&turns) {
                    say!(
                        "{}: {}",
                        m["role"].as_str().unwrap_or(""),
                        m["content"].as_str().unwrap_or("")
                    );
                }
                continue;
            }
            "/think on" => {
                set_think(&text, &mut think, Think::On);
                continue;
            }
            "/think off" => {
                set_think(&text, &mut think, Think::Off);
                continue;
            }
            "/think" => {
                say!("[use /think on or /think off]");
                continue;
            }
            cmd if cmd.starts_with('/') && !cmd.contains(char::is_whitespace) => {
                say!("[unknown command {cmd}: use {COMMANDS}]");
                continue;
            }
            // A command word with other words after it (`/clear now`, `/think maybe`) is a
            // mistyped command, not a message for the model.
            cmd if ["/quit", "/exit", "/clear", "/history", "/think"]
                .contains(&cmd.split_whitespace().next().unwrap_or("")) =>
            {
                say!("[{cmd} is not a command: use {COMMANDS}; nothing was sent]");
                continue;
            }
            _ => {}
        }
        // Drop the oldest turns until the prompt fits, never the system message or the newest
        // user turn; on a copy, so that a message refused below leaves the conversation as it was.
        let mut kept = turns.clone();
        kept.push(json!({"role": "user", "content": line}));
        let mut dropped = 0;
        let prompt = loop {
            let msgs: Vec<_> = system.iter().cloned().chain(kept.iter().cloned()).collect();
            let p = render(&text, &msgs, think)?;
            if p.ids.len() + 1 < a.max_context || kept.len() <= 1 {
                break p;
            }
            kept.remove(0);
            dropped += 1;
        };
        if prompt.ids.len() + 1 >= a.max_context {
            // Say whether a larger --max-context would help: not past the model's own limit.
            let limit = match text.max_positions {
                Some(m) if a.max_context >= m => {
                    format!(" ({m} is the model's own limit, max_position_embeddings)")
                }
                Some(m) => format!(" (the model takes up to {m})"),
                None => String::new(),
            };
            say!(
                "[the message is {} tokens with the chat framing, which does not fit --max-context {} even alone{limit}; nothing was sent and the conversation is kept, try a shorter one]",
                prompt.ids.len(),
                a.max_context
            );
            continue;
        }
        for _ in 0..dropped {
            say!(
                "[dropped the oldest message to fit --max-context {}]",
                a.max_context
            );
        }
        turns = kept;
        // The conversation so far is still in the model: only the new part is prefilled.
        interrupt.hit.store(false, Ordering::Relaxed);
        interrupt.generating.store(true, Ordering::Relaxed);
        let reasoning = Reasoning::Split {
            open: prompt.reasoning_open,
        };
        let out = reply(
            session,
            &prompt.ids,
            reasoning,
            a,
            &mut std::io::stdout().lock(),
            &interrupt.hit,
        );
        interrupt.generating.store(false, Ordering::Relaxed);
        let out = out?;
        println!();
        turns.push(json!({"role": "assistant", "content": out}));
    }
}

fn set_think(text: &TextSide, think: &mut Option<Think>, to: Think) {
    match check_think(text, to) {
        Ok(()) => {
            *think = Some(to);
            say!("[thinking {}]", if to == Think::On { "on" } else { "off" });
        }
        Err(e) => say!("[{e}]"),
    }
}

/// Ctrl-C in `run --chat`: during a reply it stops the reply (the text so far stays in the
/// conversation) and the session goes on; at the prompt it ends the session (exit 130).
struct Interrupt {
    generating: Arc<AtomicBool>,
    hit: Arc<AtomicBool>,
}

impl Interrupt {
    fn install() -> Result<Interrupt> {
        let generating = Arc::new(AtomicBool::new(false));
        let hit = Arc::new(AtomicBool::new(false));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let mut sigint = {
            let _guard = rt.enter();
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?
        };
        let (g, h) = (Arc::clone(&generating), Arc::clone(&hit));
        std::thread::Builder::new()
            .name("mference-sigint".into())
            .spawn(move || {
                rt.block_on(async move {
                    while sigint.recv().await.is_some() {
                        if g.load(Ordering::Relaxed) {
                            h.store(true, Ordering::Relaxed);
                        } else {
                            say!();
                            std::process::exit(130);
                        }
                    }
                })
            })?;
        Ok(Interrupt { generating, hit })
    }
}
