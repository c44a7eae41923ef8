//! Durations as operators write them in YAML: `500ms`, `30s`, `2m`, `1h` (a bare number is
//! rejected: the unit is part of the value).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A configuration duration, read from and written as text with a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ConfigDuration(pub Duration);

impl ConfigDuration {
    /// From seconds.
    pub const fn secs(s: u64) -> Self {
        Self(Duration::from_secs(s))
    }

    /// From milliseconds.
    pub const fn millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    /// Parses `<integer><unit>` with unit `ms`, `s`, `m` or `h`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let digits = text.chars().take_while(char::is_ascii_digit).count();
        let (number, unit) = text.split_at(digits);
        let n: u64 = number
            .parse()
            .map_err(|_| format!("{text:?} is not a duration (write e.g. 500ms, 30s, 2m, 1h)"))?;
        let ms = match unit {
            "ms" => Some(n),
            "s" => n.checked_mul(1_000),
            "m" => n.checked_mul(60_000),
            "h" => n.checked_mul(3_600_000),
            _ => {
                return Err(format!(
                    "{text:?}: the unit must be ms, s, m or h (e.g. 500ms, 30s)"
                ))
            }
        };
        ms.map(|ms| Self(Duration::from_millis(ms)))
            .ok_or_else(|| format!("{text:?} is too long"))
    }
}

impl fmt::Display for ConfigDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        match ms {
            0 => write!(f, "0s"),
            ms if ms % 3_600_000 == 0 => write!(f, "{}h", ms / 3_600_000),
            ms if ms % 60_000 == 0 => write!(f, "{}m", ms / 60_000),
            ms if ms % 1_000 == 0 => write!(f, "{}s", ms / 1_000),
            ms => write!(f, "{ms}ms"),
        }
    }
}

impl Serialize for ConfigDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ConfigDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::ConfigDuration;

    #[test]
    fn units_parse_and_print_back() {
        for (text, ms) in [
            ("500ms", 500),
            ("30s", 30_000),
            ("2m", 120_000),
            ("1h", 3_600_000),
        ] {
            let d = ConfigDuration::parse(text).expect(text);
            assert_eq!(d.0.as_millis(), ms);
            assert_eq!(d.to_string(), text);
        }
        assert_eq!(ConfigDuration::millis(1500).to_string(), "1500ms");
    }

    #[test]
    fn a_number_without_unit_or_a_bad_unit_is_rejected() {
        for bad in ["30", "", "s", "10 d", "-1s", "1.5s"] {
            assert!(ConfigDuration::parse(bad).is_err(), "{bad}");
        }
    }
}
