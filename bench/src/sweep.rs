//! The capacity sweep: hit rate and bytes moved against DRAM capacity, from the exact LRU
//! simulation at many capacities and from real replays at a few, written as CSV and drawn
//! as a PNG chart.

use std::path::Path;
use std::sync::Once;

use anyhow::Context;
use plotters::prelude::*;

use crate::sim::{self, SimTotals};
use crate::trace::{TraceRequest, TraceStats};

/// A real replay at one capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayPoint {
    /// Server's block hit rate.
    pub block_hit_rate: f64,
    /// Server's token hit rate.
    pub token_hit_rate: f64,
    /// Server's hit blocks.
    pub hit_blocks: u64,
    /// Server's evictions, when read.
    pub evictions: Option<u64>,
    /// Bytes saved.
    pub bytes_saved: u64,
    /// Bytes loaded.
    pub bytes_loaded: u64,
    /// Wall time of the replay, in seconds.
    pub wall_s: f64,
    /// Whether the LRU check held (absent when not checked).
    pub lru_holds: Option<bool>,
}

/// One capacity of the sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SweepRow {
    /// DRAM capacity in bytes (after rounding to the granule).
    pub capacity_bytes: u64,
    /// Blocks that fit.
    pub capacity_blocks: u64,
    /// The simulation's totals.
    pub sim: SimTotals,
    /// The real replay, when one ran at this capacity.
    pub replay: Option<ReplayPoint>,
}

/// Simulates `trace` at each of `capacities` (bytes), sorted ascending.
pub fn simulate_all(
    trace: &[TraceRequest],
    capacities: &[u64],
    block_bytes: u64,
    release_every: u32,
) -> Vec<SweepRow> {
    let mut caps = capacities.to_vec();
    caps.sort_unstable();
    caps.dedup();
    caps.into_iter()
        .map(|c| {
            let s = sim::simulate(trace, c, block_bytes, release_every);
            SweepRow {
                capacity_bytes: s.capacity,
                capacity_blocks: s.capacity / s.footprint,
                sim: s.totals,
                replay: None,
            }
        })
        .collect()
}

const GIB: f64 = (1u64 << 30) as f64;

/// Writes the sweep as CSV (one row per capacity; replay columns empty where none ran).
pub fn write_csv(path: &Path, rows: &[SweepRow], block_bytes: u64) -> anyhow::Result<()> {
    let mut s = String::from(
        "capacity_bytes,capacity_gib,capacity_blocks,sim_block_hit_rate,sim_token_hit_rate,sim_hit_blocks,\
         sim_evictions,sim_bytes_saved,sim_bytes_loaded,replay_block_hit_rate,replay_token_hit_rate,\
         replay_hit_blocks,replay_evictions,replay_bytes_saved,replay_bytes_loaded,replay_wall_s,lru_check\n",
    );
    for r in rows {
        let t = &r.sim;
        s.push_str(&format!(
            "{},{:.4},{},{:.6},{:.6},{},{},{},{},",
            r.capacity_bytes,
            r.capacity_bytes as f64 / GIB,
            r.capacity_blocks,
            t.block_hit_rate(),
            t.token_hit_rate(),
            t.hit_blocks,
            t.evicted_blocks,
            t.inserted_blocks * block_bytes,
            t.loaded_blocks * block_bytes,
        ));
        match &r.replay {
            Some(p) => s.push_str(&format!(
                "{:.6},{:.6},{},{},{},{},{:.1},{}\n",
                p.block_hit_rate,
                p.token_hit_rate,
                p.hit_blocks,
                p.evictions.map_or_else(String::new, |e| e.to_string()),
                p.bytes_saved,
                p.bytes_loaded,
                p.wall_s,
                match p.lru_holds {
                    Some(true) => "holds",
                    Some(false) => "FAILS",
                    None => "",
                }
            )),
            None => s.push_str(",,,,,,,\n"),
        }
    }
    std::fs::write(path, s).with_context(|| format!("cannot write {}", path.display()))
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // DejaVu Sans, embedded: the chart needs no system fonts.
        for (style, bytes) in [
            (FontStyle::Normal, dejavu::sans::regular()),
            (FontStyle::Bold, dejavu::sans::bold()),
        ] {
            if plotters::style::register_font("sans-serif", style, bytes).is_err() {
                eprintln!("warning: the embedded chart font did not load");
            }
        }
    });
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("chart: {e}")
}

/// Draws the sweep: hit rates (top) and bytes moved (bottom) against capacity (log scale),
/// the simulation as lines, real replays as markers, the infinite cache as a flat line.
pub fn draw_chart(
    path: &Path,
    rows: &[SweepRow],
    stats: &TraceStats,
    block_bytes: u64,
    subtitle: &str,
) -> anyhow::Result<()> {
    anyhow::ensure!(!rows.is_empty(), "nothing to draw");
    register_font();
    let root = BitMapBackend::new(path, (1280, 1040)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (title, body) = root.split_vertically(70);
    title
        .draw(&Text::new(
            "PegaFlow-rs: Mooncake conversation trace, LRU hit rate and bytes moved vs DRAM capacity",
            (20, 10),
            ("sans-serif", 24).into_font().style(FontStyle::Bold),
        ))
        .map_err(plot_err)?;
    title
        .draw(&Text::new(
            subtitle.to_string(),
            (20, 42),
            ("sans-serif", 16),
        ))
        .map_err(plot_err)?;
    let (top, bottom) = body.split_vertically(500);
    let lo = rows[0].capacity_bytes as f64 / GIB / 1.25;
    let hi = rows[rows.len() - 1].capacity_bytes as f64 / GIB * 1.25;
    let inf_block = sim::ratio(stats.infinite_hit_blocks, stats.blocks) * 100.0;
    let inf_token = sim::ratio(stats.infinite_hit_tokens, stats.tokens) * 100.0;
    let ymax = (inf_block.max(inf_token) * 1.15).max(5.0);

    let mut c = ChartBuilder::on(&top)
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(70)
        .caption("hit rate", ("sans-serif", 20))
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..ymax)
        .map_err(plot_err)?;
    c.configure_mesh()
        .x_desc("DRAM capacity (GiB, log scale)")
        .y_desc("hit rate (%)")
        .x_label_formatter(&|x| {
            format!("{x:.3}")
                .trim_end_matches('0')
                .trim_end_matches('.')
                .to_string()
        })
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(plot_err)?;
    let pts = |f: &dyn Fn(&SweepRow) -> f64| -> Vec<(f64, f64)> {
        rows.iter()
            .map(|r| (r.capacity_bytes as f64 / GIB, f(r)))
            .collect()
    };
    let blue = RGBColor(31, 119, 180);
    let green = RGBColor(44, 160, 44);
    let red = RGBColor(214, 39, 40);
    let grey = RGBColor(120, 120, 120);
    c.draw_series(LineSeries::new(
        pts(&|r| r.sim.block_hit_rate() * 100.0),
        blue.stroke_width(3),
    ))
    .map_err(plot_err)?
    .label("block hit rate (LRU simulation)")
    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], blue.stroke_width(3)));
    c.draw_series(LineSeries::new(
        pts(&|r| r.sim.token_hit_rate() * 100.0),
        green.stroke_width(2),
    ))
    .map_err(plot_err)?
    .label("token hit rate (LRU simulation)")
    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], green.stroke_width(2)));
    c.draw_series(LineSeries::new(
        vec![(lo, inf_block), (hi, inf_block)],
        grey.stroke_width(1),
    ))
    .map_err(plot_err)?
    .label(format!("infinite cache: {inf_block:.1}% of blocks"))
    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], grey.stroke_width(1)));
    let replays: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| {
            r.replay
                .map(|p| (r.capacity_bytes as f64 / GIB, p.block_hit_rate * 100.0))
        })
        .collect();
    if !replays.is_empty() {
        c.draw_series(
            replays
                .iter()
                .map(|&p| Circle::new(p, 7, red.stroke_width(3))),
        )
        .map_err(plot_err)?
        .label("block hit rate (server replay)")
        .legend(move |(x, y)| Circle::new((x + 12, y), 6, red.stroke_width(3)));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(plot_err)?;

    let gib_moved =
        |r: &SweepRow| ((r.sim.inserted_blocks + r.sim.loaded_blocks) * block_bytes) as f64 / GIB;
    let ymax2 = rows.iter().map(gib_moved).fold(1.0, f64::max) * 1.1;
    let mut c = ChartBuilder::on(&bottom)
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(70)
        .caption("bytes moved (whole trace)", ("sans-serif", 20))
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..ymax2)
        .map_err(plot_err)?;
    c.configure_mesh()
        .x_desc("DRAM capacity (GiB, log scale)")
        .y_desc("GiB")
        .x_label_formatter(&|x| {
            format!("{x:.3}")
                .trim_end_matches('0')
                .trim_end_matches('.')
                .to_string()
        })
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(plot_err)?;
    let orange = RGBColor(255, 127, 14);
    let purple = RGBColor(148, 103, 189);
    c.draw_series(LineSeries::new(
        pts(&|r| (r.sim.inserted_blocks * block_bytes) as f64 / GIB),
        orange.stroke_width(3),
    ))
    .map_err(plot_err)?
    .label("saved (device -> DRAM)")
    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], orange.stroke_width(3)));
    c.draw_series(LineSeries::new(
        pts(&|r| (r.sim.loaded_blocks * block_bytes) as f64 / GIB),
        purple.stroke_width(3),
    ))
    .map_err(plot_err)?
    .label("loaded (DRAM -> device)")
    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], purple.stroke_width(3)));
    c.draw_series(LineSeries::new(pts(&gib_moved), BLACK.stroke_width(2)))
        .map_err(plot_err)?
        .label("total")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.stroke_width(2)));
    let rp: Vec<(f64, f64, f64)> = rows
        .iter()
        .filter_map(|r| {
            r.replay.map(|p| {
                (
                    r.capacity_bytes as f64 / GIB,
                    p.bytes_saved as f64 / GIB,
                    p.bytes_loaded as f64 / GIB,
                )
            })
        })
        .collect();
    if !rp.is_empty() {
        c.draw_series(rp.iter().flat_map(|&(x, s, l)| {
            [
                Circle::new((x, s), 7, red.stroke_width(3)),
                Circle::new((x, l), 7, red.stroke_width(3)),
            ]
        }))
        .map_err(plot_err)?
        .label("server replay (saved, loaded)")
        .legend(move |(x, y)| Circle::new((x + 12, y), 6, red.stroke_width(3)));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_and_chart_render() {
        let trace = crate::trace::parse(
            "{\"timestamp\":0,\"input_length\":1024,\"hash_ids\":[1,2]}\n\
             {\"timestamp\":1,\"input_length\":1536,\"hash_ids\":[1,2,3]}\n\
             {\"timestamp\":2,\"input_length\":1024,\"hash_ids\":[4,5]}\n\
             {\"timestamp\":3,\"input_length\":1024,\"hash_ids\":[1,2]}\n",
        )
        .unwrap();
        let rows = simulate_all(&trace, &[4 << 30, 1 << 30, 2 << 30], 512 << 20, 0);
        assert_eq!(rows.len(), 3);
        assert!(rows[0].capacity_bytes < rows[2].capacity_bytes);
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("s.csv");
        write_csv(&csv, &rows, 512 << 20).unwrap();
        let text = std::fs::read_to_string(&csv).unwrap();
        assert_eq!(text.lines().count(), 4);
        let png = dir.path().join("s.png");
        let stats = crate::trace::stats(&trace);
        draw_chart(&png, &rows, &stats, 512 << 20, "test").unwrap();
        assert!(std::fs::metadata(&png).unwrap().len() > 1000);
    }
}
