//! `--plot FILE.svg`: bus bandwidth against message size, one line per
//! (algorithm, mode) series, in the order the rows were measured.

use std::path::Path;

use ferrocomm::{Error, Result};

/// One measured point of a series.
pub struct Point {
    pub series: String,
    pub bytes: usize,
    pub busbw: f64,
}

#[cfg(feature = "plot")]
pub fn write_svg(path: &Path, title: &str, points: &[Point]) -> Result<()> {
    use plotters::prelude::*;

    let mut series: Vec<&str> = Vec::new();
    for p in points {
        if !series.contains(&p.series.as_str()) {
            series.push(&p.series);
        }
    }
    let finite = || points.iter().filter(|p| p.busbw.is_finite() && p.bytes > 0);
    let (lo, hi) = finite().fold((f64::MAX, 0f64), |(lo, hi), p| {
        let x = (p.bytes as f64).log2();
        (lo.min(x), hi.max(x))
    });
    if hi < lo {
        return Err(Error::invalid("--plot: no rows to draw"));
    }
    // Log scale: the host's small messages and a GPU's large ones differ by
    // four orders of magnitude.
    let positive = || finite().filter(|p| p.busbw > 0.0);
    let ymax = positive().map(|p| p.busbw).fold(0f64, f64::max).max(1e-3) * 1.5;
    let ymin = positive().map(|p| p.busbw).fold(f64::MAX, f64::min).min(ymax / 10.0) / 1.5;
    let fail = |e: &dyn std::fmt::Display| Error::invalid(format!("--plot {}: {e}", path.display()));

    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(lo.floor()..hi.ceil().max(lo.floor() + 1.0), (ymin..ymax).log_scale())
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("message size")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|x| human_bytes(2f64.powf(*x)))
        .draw()
        .map_err(|e| fail(&e))?;
    for (i, name) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = positive()
            .filter(|p| p.series == *name)
            .map(|p| ((p.bytes as f64).log2(), p.busbw))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(|e| fail(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))
}

#[cfg(not(feature = "plot"))]
pub fn write_svg(_path: &Path, _title: &str, _points: &[Point]) -> Result<()> {
    Err(Error::NotCompiled {
        backend: "plot",
        feature: "plot",
    })
}

/// `4 KiB`, `16 MiB`: sizes as the tables print them.
pub fn human_bytes(b: f64) -> String {
    let b = b.round() as u64;
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
