//! `ember list` and `ember rm`: the models in ember's pinned-model cache and in the
//! huggingface_hub cache (see [`ember::models`] and [`ember::hub::cache`]).

use anyhow::bail;
use clap::Args;
use ember::hub::{cache, HubConfig, HubSpec};
use ember::models;
use ember_gpu::pool::format_bytes;

#[derive(Debug, Args)]
pub struct ListArgs {}

#[derive(Debug, Args)]
pub struct RmArgs {
    /// What to remove: `hf://OWNER/REPO` (the whole repository), `hf://OWNER/REPO:QUANT` (that
    /// quant's files), or a pinned model's name.
    pub model: String,
}

pub fn list(_args: ListArgs) -> anyhow::Result<()> {
    let mut any = false;
    for m in models::list() {
        if models::is_cached(m)? {
            any = true;
            println!(
                "{:48} {:>10}  {}",
                m.name,
                format_bytes(m.bytes),
                models::cached_path(m)?.display()
            );
        }
    }
    let config = HubConfig::from_env()?;
    for f in cache::list(&config.cache_dir) {
        any = true;
        let name = format!("hf://{}  {}", f.repo, f.file);
        println!(
            "{name:48} {:>10}  {}{}",
            format_bytes(f.bytes),
            f.path.display(),
            if f.current { "" } else { "  (older commit)" }
        );
    }
    if !any {
        eprintln!(
            "no models cached (pinned: {}; hub: {})",
            models::models_dir()?.display(),
            config.cache_dir.display()
        );
    }
    Ok(())
}

pub fn rm(args: RmArgs) -> anyhow::Result<()> {
    if HubSpec::is_hub(&args.model) {
        let spec = HubSpec::parse(&args.model)?;
        let config = HubConfig::from_env()?;
        for path in cache::remove(&config.cache_dir, &spec)? {
            println!("removed {}", path.display());
        }
        return Ok(());
    }
    let Some(entry) = models::find(&args.model) else {
        bail!(models::PullError::UnknownModel {
            name: args.model.clone(),
            known: models::known_names(),
        });
    };
    let path = models::cached_path(entry)?;
    if !path.is_file() {
        bail!("{} is not cached ({})", entry.name, path.display());
    }
    std::fs::remove_file(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    println!("removed {}", path.display());
    Ok(())
}
