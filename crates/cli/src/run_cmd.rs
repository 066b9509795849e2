//! `run` and `perplexity`.

use clap::Args;

#[derive(Args)]
pub struct RunArgs {}
#[derive(Args)]
pub struct PerplexityArgs {}

pub fn run(_a: RunArgs) -> anyhow::Result<()> {
    anyhow::bail!("run is not built yet")
}
pub fn perplexity(_a: PerplexityArgs) -> anyhow::Result<()> {
    anyhow::bail!("perplexity is not built yet")
}
