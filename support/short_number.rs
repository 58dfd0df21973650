//! A number read from user input (a request, a configuration or spec, a model's or adapter's
//! file), as an error message echoes it: short, so that a value of hundreds of digits
//! (`1e300`, which `{}` writes out whole) is not echoed whole. One file included (`#[path]`)
//! by each crate that echoes such numbers: no crate of the workspace is below all of them
//! (the GPU crate and `config` depend on none), and a crate for one function would be more
//! than it is. Each crate uses what it needs of it.
#![allow(dead_code)]

/// `v` as an operator wrote it, short: `1e308` and `1e-6` rather than 309 digits or
/// `0.000001`; plain decimals between a thousandth and a million. An `f32` is written as an
/// `f32` (`3e38`, not the digits of its widening to `f64`).
pub fn short_number<T>(v: T) -> String
where
    T: Copy + Into<f64> + std::fmt::Display + std::fmt::LowerExp,
{
    let f: f64 = v.into();
    if f != 0.0 && f.is_finite() && !(1e-3..1e6).contains(&f.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// `message` (serde_yaml's, of a value of the wrong type) with each `floating point `...``
/// serde wrote of more than 24 characters short: serde writes a float whole (`1e300` as 301
/// digits and `.0`).
pub fn short_float_echoes(message: &str) -> String {
    const MARK: &str = "floating point `";
    let mut out = String::with_capacity(message.len().min(1024));
    let mut rest = message;
    while let Some(at) = rest.find(MARK) {
        let (before, after) = rest.split_at(at + MARK.len());
        out.push_str(before);
        let end = after.find('`').unwrap_or(after.len());
        let (number, tail) = after.split_at(end);
        // Only a long one: `1.0` stays as serde wrote it.
        match number.parse::<f64>() {
            Ok(v) if number.len() > 24 => out.push_str(&short_number(v)),
            _ => out.push_str(number),
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::{short_float_echoes, short_number};

    #[test]
    fn serdes_floats_are_written_short() {
        let long = format!("1{}.0", "0".repeat(300));
        let m = format!("invalid type: floating point `{long}`, expected u32 at line 1");
        assert_eq!(
            short_float_echoes(&m),
            "invalid type: floating point `1e300`, expected u32 at line 1"
        );
        let m = format!(
            "floating point `2.0`, then floating point `-0.{}1`",
            "0".repeat(30)
        );
        assert_eq!(
            short_float_echoes(&m),
            "floating point `2.0`, then floating point `-1e-31`"
        );
        for kept in [
            "no number here",
            "floating point `NaN`",
            "floating point `x",
            "",
        ] {
            assert_eq!(short_float_echoes(kept), kept);
        }
    }

    #[test]
    fn long_numbers_are_written_short() {
        assert_eq!(short_number(1e300), "1e300");
        assert_eq!(short_number(-1e300), "-1e300");
        assert_eq!(short_number(1.5e-7), "1.5e-7");
        assert_eq!(short_number(f32::MAX), "3.4028235e38");
        assert_eq!(short_number(0.5f32), "0.5");
        assert_eq!(short_number(0.001), "0.001");
        assert_eq!(short_number(999_999.5), "999999.5");
        assert_eq!(short_number(1e6), "1e6");
        assert_eq!(short_number(0.0), "0");
        assert_eq!(short_number(f64::NAN), "NaN");
        assert_eq!(short_number(f64::NEG_INFINITY), "-inf");
    }
}
