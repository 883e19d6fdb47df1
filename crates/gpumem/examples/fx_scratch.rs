use gpumem::resource::sim::CostModel;
use gpumem::trace::synthetic::Kind;
use gpumem::trace::{replay_simulated_at, SIM_CAPACITY};
use gpumem::Config;
fn main() {
    let kind = Kind::from_name(&std::env::args().nth(1).unwrap_or("fixed_shape".into())).unwrap();
    for seed in 0..16u64 {
        let ev = kind.generate(seed, 1);
        let lag = [None, Some(300), Some(3000)][(seed % 3) as usize];
        let r = replay_simulated_at(
            "x",
            &ev,
            &Config::default(),
            SIM_CAPACITY,
            lag,
            CostModel::default(),
        )
        .unwrap();
        let n = r.calls.len();
        let last = r.calls[n - 1];
        let quiet = r.calls.iter().position(|&c| c == last).unwrap();
        // where the reserved peak is reached
        let peak = r.timeline.iter().map(|t| t.2).max().unwrap();
        let at = r.timeline.iter().position(|t| t.2 == peak).unwrap();
        let livepk = r.timeline.iter().map(|t| t.1).max().unwrap();
        let lat = r.timeline.iter().position(|t| t.1 == livepk).unwrap();
        let end_res = r.timeline[n - 1].2;
        // reserved over the last quarter vs live peak
        let late = r.timeline[n * 3 / 4..].iter().map(|t| t.2).max().unwrap();
        println!("seed {seed:>2} ratio {:.4} events {n} live peak at {lat} reserved peak at {at}; last call at {quiet}; late reserved / live peak {:.4}; planned at peak {}", r.report.ratio, late as f64 / livepk as f64, r.report.planned_bytes_at_peak);
        let _ = end_res;
    }
}
