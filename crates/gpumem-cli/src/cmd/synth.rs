//! `gpumem synth`: a synthetic trace of one workload kind.

use crate::output::Result;

pub fn run(kind: &str, output: &std::path::Path, seed: u64, scale: usize) -> Result<()> {
    use gpumem::trace::synthetic::Kind;
    let k = Kind::from_name(kind).ok_or_else(|| {
        let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        format!("unknown workload `{kind}` (known: {})", names.join(", "))
    })?;
    let events = k.generate(seed, scale);
    gpumem::trace::write_trace(output, &events)?;
    eprintln!("wrote {} ({} events)", output.display(), events.len());
    Ok(())
}
