//! The simulator's charts, drawn with plotters' SVG backend (no system fonts or image
//! libraries): one run per policy as bars, and the load ladder as lines (TTFT p90 on a log
//! scale with the SLO, and hit rate).

use std::path::Path;

use plotters::coord::CoordTranslate;
use plotters::prelude::*;
use thiserror::Error;

use super::report::{axes, cell, mean_of, LadderRun};
use super::PolicyReport;

/// A chart that could not be drawn (its file, or the drawing backend).
#[derive(Debug, Error)]
#[error("drawing a chart: {0}")]
pub struct ChartError(pub String);

fn chart_error<E: std::fmt::Display>(e: E) -> ChartError {
    ChartError(e.to_string())
}

/// One run per policy: TTFT p50 and p90 (left) and hit rate (right) as bars, one row per
/// policy.
pub fn draw_policies(path: &Path, reports: &[PolicyReport]) -> Result<(), ChartError> {
    let n = reports.len().max(1);
    let rows = n as f64;
    let root = SVGBackend::new(path, (960, 140 + 36 * n as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let (left, right) = root.split_horizontally(620);
    let max_ttft = reports.iter().map(|r| r.ttft_p90_ms).fold(1.0, f64::max) * 1.1;
    let labels: Vec<String> = reports.iter().map(|r| r.policy.clone()).collect();
    // Row i spans [n - i - 1, n - i): the first policy on top.
    let row = |i: usize| (rows - i as f64 - 0.9, rows - i as f64 - 0.1);
    let label = |y: &f64| {
        let i = (rows - y - 0.5).round();
        if (rows - y - 0.5 - i).abs() < 0.01 && i >= 0.0 {
            labels.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let mut ttft = ChartBuilder::on(&left)
        .caption("TTFT p50 (dark) and p90, ms", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(130)
        .build_cartesian_2d(0.0..max_ttft, 0.0..rows)
        .map_err(chart_error)?;
    ttft.configure_mesh()
        .disable_y_mesh()
        .y_labels(2 * n + 1)
        .y_label_formatter(&label)
        .draw()
        .map_err(chart_error)?;
    for (i, r) in reports.iter().enumerate() {
        let (y0, y1) = row(i);
        for (value, color) in [
            (r.ttft_p90_ms, RGBColor(158, 202, 225)),
            (r.ttft_p50_ms, RGBColor(49, 130, 189)),
        ] {
            ttft.draw_series(std::iter::once(Rectangle::new(
                [(0.0, y0), (value, y1)],
                color.filled(),
            )))
            .map_err(chart_error)?;
        }
    }
    let mut hits = ChartBuilder::on(&right)
        .caption("prefix-hit rate, %", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(10)
        .build_cartesian_2d(0.0..100.0, 0.0..rows)
        .map_err(chart_error)?;
    hits.configure_mesh()
        .disable_y_mesh()
        .y_label_formatter(&|_| String::new())
        .draw()
        .map_err(chart_error)?;
    hits.draw_series(reports.iter().enumerate().map(|(i, r)| {
        let (y0, y1) = row(i);
        Rectangle::new(
            [(0.0, y0), (100.0 * r.token_hit_rate, y1)],
            RGBColor(49, 163, 84).filled(),
        )
    }))
    .map_err(chart_error)?;
    root.present()
        .map_err(|e| ChartError(format!("writing {}: {e}", path.display())))
}

/// One line with points per policy, in the palette's order, each in the legend.
fn policy_lines<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), ChartError>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate<From = (f64, f64)>,
{
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(chart_error)?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(chart_error)?;
    }
    Ok(())
}

fn legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<(), ChartError>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(chart_error)
}

/// The ladder: TTFT p90 (mean over seeds, log scale) against offered load per policy, with
/// the SLO as a dashed line, in `path`; hit rate against offered load per policy in
/// `<path stem>-hits.svg`.
pub fn draw_ladder(path: &Path, runs: &[LadderRun], slo_ms: f64) -> Result<(), ChartError> {
    let (policies, mut rates) = axes(runs);
    rates.sort_by(f64::total_cmp);
    let max_rate = rates.last().copied().unwrap_or(1.0) * 1.05;
    let series = |f: &dyn Fn(&LadderRun) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        policies
            .iter()
            .map(|p| {
                let points = rates
                    .iter()
                    .map(|&rate| (rate, mean_of(&cell(runs, p, rate), |r| f(r)).0))
                    .collect();
                (p.clone(), points)
            })
            .collect()
    };
    let ttft = series(&|r| r.ttft_p90_ms.max(1.0));
    let max_ttft = ttft
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|p| p.1))
        .fold(slo_ms, f64::max)
        * 2.0;
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT p90 against offered load", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..max_rate, (1.0..max_ttft).log_scale())
        .map_err(chart_error)?;
    chart
        .configure_mesh()
        .x_desc("offered load, requests/s")
        .y_desc("TTFT p90, ms (log)")
        .draw()
        .map_err(chart_error)?;
    policy_lines(&mut chart, &ttft)?;
    chart
        .draw_series(DashedLineSeries::new(
            vec![(0.0, slo_ms), (max_rate, slo_ms)],
            6,
            4,
            BLACK.stroke_width(1),
        ))
        .map_err(chart_error)?
        .label(format!("SLO {slo_ms} ms"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(chart_error)?;

    let hits_path = path.with_file_name(format!(
        "{}-hits.svg",
        path.file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("ladder")
    ));
    let hits = series(&|r| 100.0 * r.hit_rate);
    let root = SVGBackend::new(&hits_path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("prefix-hit rate against offered load", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_rate, 0.0..100.0)
        .map_err(chart_error)?;
    chart
        .configure_mesh()
        .x_desc("offered load, requests/s")
        .y_desc("prompt tokens from cache, %")
        .draw()
        .map_err(chart_error)?;
    policy_lines(&mut chart, &hits)?;
    legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
    root.present()
        .map_err(|e| ChartError(format!("writing {}: {e}", hits_path.display())))
}
