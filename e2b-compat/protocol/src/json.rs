//! Tolerant decoding of protobuf-JSON request fields, as the proto3 JSON
//! mapping allows them: integers as numbers or strings, enums as names or
//! numbers, bytes as (url-safe or standard, padded or not) base64, and
//! `null` for "unset". Field names accept both spellings through serde
//! aliases on the message types.

use base64::Engine;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

fn number_from<E: serde::de::Error>(v: &Value) -> Result<Option<i64>, E> {
    match v {
        Value::Null => Ok(None),
        Value::Number(n) => n
            .as_i64()
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
            .map(Some)
            .ok_or_else(|| E::custom(format!("not an integer: {n}"))),
        Value::String(s) => s.trim().parse::<i64>().map(Some).map_err(|_| E::custom(format!("not an integer: {s:?}"))),
        other => Err(E::custom(format!("expected an integer, got {other}"))),
    }
}

/// An unsigned 32-bit field (pid, cols, rows, depth).
pub fn u32_field<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = Value::deserialize(d)?;
    let n = number_from::<D::Error>(&v)?.unwrap_or(0);
    u32::try_from(n).map_err(|_| D::Error::custom(format!("out of range for uint32: {n}")))
}

/// An optional unsigned 32-bit field, kept unset when absent or null.
pub fn opt_u32_field<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let v = Value::deserialize(d)?;
    match number_from::<D::Error>(&v)? {
        None => Ok(None),
        Some(n) => u32::try_from(n).map(Some).map_err(|_| D::Error::custom(format!("out of range for uint32: {n}"))),
    }
}

/// A `bytes` field: base64 in any of the common alphabets.
pub fn bytes_field<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
    let v = Value::deserialize(d)?;
    match v {
        Value::Null => Ok(None),
        Value::String(s) => decode_base64(&s).map(Some).map_err(D::Error::custom),
        other => Err(D::Error::custom(format!("expected base64 string, got {other}"))),
    }
}

pub fn decode_base64(s: &str) -> Result<Vec<u8>, String> {
    use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE_NO_PAD};
    let trimmed = s.trim_end_matches('=');
    if trimmed.contains(['-', '_']) { URL_SAFE_NO_PAD.decode(trimmed) } else { STANDARD_NO_PAD.decode(trimmed) }
        .map_err(|e| format!("invalid base64: {e}"))
}

pub fn encode_base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A string field that may be sent as null.
pub fn string_field<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// A repeated string field that may be sent as null.
pub fn strings_field<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(Option::<Vec<String>>::deserialize(d)?.unwrap_or_default())
}

/// A bool field that may be sent as null (or, leniently, as a string).
pub fn bool_field<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(opt_bool_field(d)?.unwrap_or(false))
}

pub fn opt_bool_field<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    match Value::deserialize(d)? {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(b)),
        Value::String(s) if s == "true" => Ok(Some(true)),
        Value::String(s) if s == "false" => Ok(Some(false)),
        other => Err(D::Error::custom(format!("expected a bool, got {other}"))),
    }
}

/// A `map<string,string>` field that may be sent as null.
pub fn string_map_field<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<std::collections::HashMap<String, String>, D::Error> {
    Ok(Option::<std::collections::HashMap<String, String>>::deserialize(d)?.unwrap_or_default())
}

/// An enum field given by name (`"SIGNAL_SIGKILL"`) or number (`9`).
pub fn enum_value<E: serde::de::Error>(v: &Value, names: &[(&str, i32)]) -> Result<i32, E> {
    match v {
        Value::Null => Ok(0),
        Value::String(s) => names
            .iter()
            .find(|(name, _)| name == s)
            .map(|(_, n)| *n)
            .or_else(|| s.parse().ok())
            .ok_or_else(|| E::custom(format!("unknown enum value {s:?}"))),
        other => number_from::<E>(other)?
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| E::custom("enum number out of range")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct T {
        #[serde(default, deserialize_with = "u32_field")]
        n: u32,
        #[serde(default, deserialize_with = "bytes_field")]
        b: Option<Vec<u8>>,
        #[serde(default, deserialize_with = "opt_bool_field")]
        f: Option<bool>,
    }

    fn parse(s: &str) -> Result<T, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn integers_as_numbers_or_strings() {
        assert_eq!(parse(r#"{"n": 7}"#).unwrap().n, 7);
        assert_eq!(parse(r#"{"n": "7"}"#).unwrap().n, 7);
        assert_eq!(parse(r#"{"n": 7.0}"#).unwrap().n, 7);
        assert_eq!(parse(r#"{"n": null}"#).unwrap().n, 0);
        assert_eq!(parse(r#"{}"#).unwrap().n, 0);
        assert!(parse(r#"{"n": -1}"#).is_err());
        assert!(parse(r#"{"n": "x"}"#).is_err());
    }

    #[test]
    fn bytes_in_every_base64_flavour() {
        assert_eq!(parse(r#"{"b": "aGk/"}"#).unwrap().b.unwrap(), b"hi?");
        assert_eq!(parse(r#"{"b": "aGk_"}"#).unwrap().b.unwrap(), b"hi?");
        assert_eq!(parse(r#"{"b": "aGk="}"#).unwrap().b.unwrap(), b"hi");
        assert_eq!(parse(r#"{"b": "aGk"}"#).unwrap().b.unwrap(), b"hi");
        assert!(parse(r#"{"b": null}"#).unwrap().b.is_none());
    }

    #[test]
    fn optional_bools_keep_unset_apart_from_false() {
        assert_eq!(parse(r#"{"f": false}"#).unwrap().f, Some(false));
        assert_eq!(parse(r#"{}"#).unwrap().f, None);
    }

    #[test]
    fn enums_by_name_or_number() {
        let names = [("SIGNAL_SIGKILL", 9), ("SIGNAL_SIGTERM", 15)];
        let e = |v: Value| enum_value::<serde_json::Error>(&v, &names);
        assert_eq!(e(Value::from("SIGNAL_SIGKILL")).unwrap(), 9);
        assert_eq!(e(Value::from(15)).unwrap(), 15);
        assert_eq!(e(Value::from("15")).unwrap(), 15);
        assert!(e(Value::from("SIGNAL_NOPE")).is_err());
    }
}
