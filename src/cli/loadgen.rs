//! `kv-indexer loadgen`: vLLM-shaped load against a running daemon (`kv_lab::loadgen`), its
//! report printed as text or JSON.

pub use kv_lab::loadgen::LoadgenArgs;

/// Runs the load and prints the report.
pub fn run(args: LoadgenArgs) -> anyhow::Result<()> {
    let json = args.json;
    let report = kv_lab::loadgen::run(args)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{}", report.to_text());
    }
    Ok(())
}
