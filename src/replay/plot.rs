//! Memory over a replay as an SVG drawing: reserved (solid) and requested (dashed) bytes over the
//! events, one colour per configuration, one panel per workload. Hand-written SVG, no
//! dependencies; long runs are reduced to a bounded number of points per line.

use super::engine::MemoryPoint;
use std::fmt::Write;

/// One line pair (reserved and requested) to draw.
#[derive(Debug, Clone, Copy)]
pub struct PlotSeries<'a> {
    /// The configuration's name, for the legend.
    pub label: &'a str,
    pub timeline: &'a [MemoryPoint],
}

/// One workload's panel.
#[derive(Debug, Clone)]
pub struct PlotPanel<'a> {
    pub title: &'a str,
    pub series: Vec<PlotSeries<'a>>,
}

const WIDTH: f64 = 1000.0;
const PANEL_HEIGHT: f64 = 420.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// Points per line at most: buckets of events keep their lowest and highest value, in order,
/// so peaks survive the reduction.
const MAX_BUCKETS: usize = 800;
/// Colour-blind-safe palette (Okabe-Ito), then repeated.
const COLOURS: [&str; 8] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442",
];
const GIB: f64 = (1u64 << 30) as f64;

/// The SVG document for `panels`, stacked vertically.
pub fn render_svg(panels: &[PlotPanel<'_>]) -> String {
    let height = PANEL_HEIGHT * panels.len().max(1) as f64;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    for (index, panel) in panels.iter().enumerate() {
        render_panel(&mut svg, panel, index as f64 * PANEL_HEIGHT);
    }
    svg.push_str("</svg>\n");
    svg
}

fn render_panel(svg: &mut String, panel: &PlotPanel<'_>, y0: f64) {
    let plot_width = WIDTH - LEFT - RIGHT;
    let plot_height = PANEL_HEIGHT - TOP - BOTTOM;
    let events = panel
        .series
        .iter()
        .map(|s| s.timeline.len().saturating_sub(1))
        .max()
        .unwrap_or(0)
        .max(1);
    let highest = panel
        .series
        .iter()
        .flat_map(|s| s.timeline.iter())
        .map(|p| p.reserved.max(p.requested))
        .max()
        .unwrap_or(0);
    let (y_step, y_max) = axis_scale(highest as f64 / GIB);
    let (x_step, x_max) = axis_scale(events as f64);
    let x_of = |event: f64| LEFT + event / x_max * plot_width;
    let y_of = |gib: f64| y0 + TOP + plot_height - gib / y_max * plot_height;

    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="{}" font-size="15" font-weight="bold">{}</text>"#,
        y0 + TOP - 14.0,
        escape(panel.title)
    );
    // Axes, grid and labels.
    let mut tick = 0.0;
    while tick <= y_max + y_step / 2.0 {
        let y = y_of(tick);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end">{} GiB</text>"##,
            LEFT + plot_width,
            LEFT - 6.0,
            y + 4.0,
            trim_number(tick)
        );
        tick += y_step;
    }
    let mut tick = 0.0;
    while tick <= x_max + x_step / 2.0 {
        let x = x_of(tick);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#808080"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            y_of(0.0),
            y_of(0.0) + 5.0,
            y_of(0.0) + 18.0,
            trim_number(tick)
        );
        tick += x_step;
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{:.1}" width="{plot_width:.1}" height="{plot_height:.1}" fill="none" stroke="#808080"/>"##,
        y0 + TOP
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">events replayed</text>"#,
        LEFT + plot_width / 2.0,
        y0 + PANEL_HEIGHT - 12.0
    );

    // Requested lines first: they are the same under every setting, so the reserved lines,
    // which differ, are drawn on top of them.
    for (pick, dash) in [
        (
            requested as fn(&MemoryPoint) -> u64,
            r#" stroke-dasharray="6 4""#,
        ),
        (reserved as fn(&MemoryPoint) -> u64, ""),
    ] {
        for (index, series) in panel.series.iter().enumerate() {
            let colour = COLOURS[index % COLOURS.len()];
            let mut path = String::new();
            for (event, bytes) in reduce(series.timeline, pick) {
                let _ = write!(
                    path,
                    "{:.1},{:.1} ",
                    x_of(event as f64),
                    y_of(bytes as f64 / GIB)
                );
            }
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} points="{}"/>"#,
                path.trim_end()
            );
        }
    }
    for (index, series) in panel.series.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        let y = y0 + TOP + 10.0 + 20.0 * index as f64;
        let x = LEFT + plot_width + 15.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="2.5"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            x + 24.0,
            x + 30.0,
            y + 4.0,
            escape(series.label)
        );
    }
    let y = y0 + TOP + 10.0 + 20.0 * panel.series.len() as f64 + 10.0;
    let x = LEFT + plot_width + 15.0;
    let _ = writeln!(
        svg,
        r##"<line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#404040" stroke-width="1.5"/><text x="{:.1}" y="{:.1}">reserved</text><line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#404040" stroke-width="1.5" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}">allocated (requested)</text>"##,
        x + 24.0,
        x + 30.0,
        y + 4.0,
        y + 20.0,
        x + 24.0,
        y + 20.0,
        x + 30.0,
        y + 24.0
    );
}

fn reserved(point: &MemoryPoint) -> u64 {
    point.reserved
}

fn requested(point: &MemoryPoint) -> u64 {
    point.requested
}

/// `(event, value)` pairs, at most two per bucket (its lowest and highest, in event order).
fn reduce(timeline: &[MemoryPoint], pick: fn(&MemoryPoint) -> u64) -> Vec<(usize, u64)> {
    if timeline.len() <= 2 * MAX_BUCKETS {
        return timeline
            .iter()
            .enumerate()
            .map(|(i, p)| (i, pick(p)))
            .collect();
    }
    let bucket = timeline.len().div_ceil(MAX_BUCKETS);
    let mut out = Vec::with_capacity(2 * MAX_BUCKETS);
    for (chunk_index, chunk) in timeline.chunks(bucket).enumerate() {
        let base = chunk_index * bucket;
        let values = chunk.iter().map(pick).enumerate();
        let (low_at, low) = values.clone().min_by_key(|&(_, v)| v).unwrap_or((0, 0));
        let (high_at, high) = values.max_by_key(|&(_, v)| v).unwrap_or((0, 0));
        let (first, second) = if low_at <= high_at {
            ((low_at, low), (high_at, high))
        } else {
            ((high_at, high), (low_at, low))
        };
        out.push((base + first.0, first.1));
        if second.0 != first.0 {
            out.push((base + second.0, second.1));
        }
    }
    out
}

/// A round tick step (1, 2 or 5 times a power of ten) giving three to six ticks up to `highest`,
/// and the axis maximum (a whole number of steps).
fn axis_scale(highest: f64) -> (f64, f64) {
    if !highest.is_finite() || highest <= 0.0 {
        return (1.0, 1.0);
    }
    let rough = highest / 6.0;
    let magnitude = 10f64.powf(rough.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= rough)
        .unwrap_or(10.0 * magnitude);
    (step, (highest / step).ceil().max(1.0) * step)
}

/// A tick label without float noise: `0.30000000000000004` as `0.3`.
fn trim_number(value: f64) -> String {
    let text = format!("{value:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".to_string()
    } else {
        text.to_string()
    }
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<MemoryPoint> {
        (0..n as u64)
            .map(|i| MemoryPoint {
                requested: i << 20,
                reserved: (i + 10) << 20,
            })
            .collect()
    }

    #[test]
    fn long_runs_are_reduced_and_keep_their_extremes() {
        let mut timeline = ramp(100_000);
        timeline[54_321].reserved = 1 << 40;
        let points = reduce(&timeline, reserved);
        assert!(points.len() <= 2 * MAX_BUCKETS, "{}", points.len());
        assert!(points.contains(&(54_321, 1 << 40)));
        assert!(points.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(reduce(&timeline[..10], reserved).len(), 10);
    }

    #[test]
    fn axis_steps_are_round() {
        assert_eq!(axis_scale(18.3), (5.0, 20.0));
        assert_eq!(axis_scale(0.12), (0.02, 0.12));
        assert_eq!(axis_scale(10_515.0), (2000.0, 12_000.0));
        assert_eq!(axis_scale(4657.0), (1000.0, 5000.0));
        assert_eq!(axis_scale(0.0), (1.0, 1.0));
        assert_eq!(trim_number(0.30000000000000004), "0.3");
    }

    #[test]
    fn the_drawing_has_a_line_pair_and_a_legend_entry_per_configuration() {
        let a = ramp(50);
        let b = ramp(3000);
        let svg = render_svg(&[PlotPanel {
            title: "a <trace> & more",
            series: vec![
                PlotSeries {
                    label: "PyTorch defaults",
                    timeline: &a,
                },
                PlotSeries {
                    label: "expandable_segments:True",
                    timeline: &b,
                },
            ],
        }]);
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert_eq!(svg.matches("stroke-dasharray").count(), 3);
        assert!(svg.contains("a &lt;trace&gt; &amp; more"));
        assert!(svg.contains("expandable_segments:True"));
        assert!(svg.contains(" GiB</text>"));
        // An empty panel still draws.
        let empty = render_svg(&[PlotPanel {
            title: "nothing",
            series: Vec::new(),
        }]);
        assert!(empty.contains("nothing"));
    }
}
