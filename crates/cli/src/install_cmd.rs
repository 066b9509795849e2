//! `install`, `verify`, `inspect`, `discard`.

use clap::Args;

#[derive(Args)]
pub struct InstallArgs {}
#[derive(Args)]
pub struct VerifyArgs {}
#[derive(Args)]
pub struct InspectArgs {}
#[derive(Args)]
pub struct DiscardArgs {}

pub fn install(_a: InstallArgs) -> anyhow::Result<()> {
    anyhow::bail!("install is not built yet")
}
pub fn verify(_a: VerifyArgs) -> anyhow::Result<()> {
    anyhow::bail!("verify is not built yet")
}
pub fn inspect(_a: InspectArgs) -> anyhow::Result<()> {
    anyhow::bail!("inspect is not built yet")
}
pub fn discard(_a: DiscardArgs) -> anyhow::Result<()> {
    anyhow::bail!("discard is not built yet")
}
