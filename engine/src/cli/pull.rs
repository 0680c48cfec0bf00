//! `ember pull`: fetch pinned models (see [`ember::models`]) or Hugging Face hub models (see
//! [`ember::hub`]) into their caches.

use anyhow::bail;
use clap::Args;
use ember::models;

use super::load::BarProgress;

#[derive(Debug, Args)]
pub struct PullArgs {
    /// The model to fetch: a pinned name (see --list), or `hf://OWNER/REPO[:QUANT]` for a GGUF
    /// from the Hugging Face hub (quant Q4_K_M unless named; HF_TOKEN and HF_ENDPOINT are used;
    /// stored in the huggingface_hub cache, $HF_HOME/hub).
    pub name: Option<String>,
    /// Fetch every pinned model.
    #[arg(long, conflicts_with = "name")]
    pub all: bool,
    /// List the pinned models and whether they are cached.
    #[arg(long, conflicts_with_all = ["name", "all"])]
    pub list: bool,
}

pub fn run(args: PullArgs) -> anyhow::Result<()> {
    if args.list {
        for m in models::list() {
            let cached = models::is_cached(m)?;
            println!(
                "{:32} {:>10.1} MiB  {:8} {}",
                m.name,
                m.bytes as f64 / (1024.0 * 1024.0),
                m.architecture,
                if cached { "cached" } else { "not cached" }
            );
        }
        return Ok(());
    }
    if let Some(name) = args
        .name
        .as_deref()
        .filter(|n| ember::hub::HubSpec::is_hub(n))
    {
        let spec = ember::hub::HubSpec::parse(name)?;
        let config = ember::hub::HubConfig::from_env()?;
        let mut progress = BarProgress::new();
        let path = ember::hub::pull(&spec, &config, &mut progress);
        progress.finish();
        println!("{}", path?.display());
        return Ok(());
    }
    let entries: Vec<&models::ModelEntry> = match (&args.name, args.all) {
        (_, true) => models::list().iter().collect(),
        (Some(name), false) => match models::find(name) {
            Some(m) => vec![m],
            None => {
                return Err(models::PullError::UnknownModel {
                    name: name.clone(),
                    known: models::known_names(),
                }
                .into())
            }
        },
        (None, false) => bail!(
            "expected a model name or --all (names: {})",
            models::known_names()
        ),
    };
    for entry in entries {
        let mut progress = BarProgress::new();
        let path = models::pull(entry, true, &mut progress);
        progress.finish();
        println!("{}", path?.display());
    }
    Ok(())
}
