//! `${{ }}` in a job's `strategy.matrix`, evaluated the way Gitea's jobparser does when it
//! expands a job after the jobs it needs ended: against `needs`, `inputs`, `vars` and
//! `github`, with GitHub's functions (`fromJSON`, `format`, `contains`, …).
//!
//! github-actions-expressions parses and evaluates constant expressions but knows no
//! contexts, so each context reference is replaced by a literal of its value (objects and
//! arrays as `fromJSON('…')`) and the constant expression left is evaluated. Pure; the
//! contexts are a JSON object keyed by lower-case context name.

use github_actions_expressions::{Expr, context::Context, literal::Literal};
use serde_json::Value as Json;
use serde_yaml_ng::Value;

/// Why an expression gave no value; the text says which expression and what to change.
#[derive(Debug, thiserror::Error)]
#[error("${{{{ {expression} }}}}: {reason}")]
pub struct ExpressionError {
    pub expression: String,
    pub reason: String,
}

/// `value` with every `${{ }}` in its strings (and mapping keys) evaluated: a string that
/// is one expression becomes the expression's value (e.g. the list `fromJSON` gives),
/// one with text around expressions becomes the text with their values.
///
/// # Errors
/// The first expression that does not parse or cannot be evaluated with `contexts`.
pub fn evaluate_value(value: &Value, contexts: &Json) -> Result<Value, ExpressionError> {
    Ok(match value {
        Value::String(text) => interpolate(text, contexts)?,
        Value::Sequence(items) => Value::Sequence(items.iter().map(|item| evaluate_value(item, contexts)).collect::<Result<_, _>>()?),
        Value::Mapping(mapping) => {
            let mut evaluated = serde_yaml_ng::Mapping::new();
            for (key, item) in mapping {
                evaluated.insert(evaluate_value(key, contexts)?, evaluate_value(item, contexts)?);
            }
            Value::Mapping(evaluated)
        }
        other => other.clone(),
    })
}

/// Whether `value` holds an expression anywhere (keys included).
pub fn has_expression(value: &Value) -> bool {
    match value {
        Value::String(text) => text.contains("${{"),
        Value::Sequence(items) => items.iter().any(has_expression),
        Value::Mapping(mapping) => mapping.iter().any(|(key, item)| has_expression(key) || has_expression(item)),
        _ => false,
    }
}

fn interpolate(text: &str, contexts: &Json) -> Result<Value, ExpressionError> {
    let trimmed = text.trim();
    if let Some(inner) = trimmed.strip_prefix("${{").and_then(|rest| rest.strip_suffix("}}"))
        && !inner.contains("${{")
    {
        let json = evaluate(inner.trim(), contexts)?;
        return serde_yaml_ng::to_value(json).map_err(|e| ExpressionError { expression: inner.trim().to_owned(), reason: e.to_string() });
    }
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 3..];
        let end = after.find("}}").ok_or_else(|| ExpressionError { expression: after.trim().to_owned(), reason: "has no closing }}".into() })?;
        out.push_str(&text_of(&evaluate(after[..end].trim(), contexts)?));
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(Value::String(out))
}

/// A value as `${{ }}` in text shows it.
fn text_of(value: &Json) -> String {
    match value {
        Json::String(s) => s.clone(),
        Json::Null => String::new(),
        other => other.to_string(),
    }
}

/// Evaluates one expression (without `${{ }}`).
///
/// # Errors
/// A syntax error, an unknown context or function, or what cannot be known before a job
/// runs (`steps`, `job`, `runner`, `hashFiles`, status functions).
pub fn evaluate(expression: &str, contexts: &Json) -> Result<Json, ExpressionError> {
    let error = |reason: String| ExpressionError { expression: expression.to_owned(), reason };
    let parsed = Expr::parse(expression).map_err(|e| error(e.to_string()))?;
    // Outermost references only: `a[b.c]` is replaced whole (its index resolved inside).
    let mut references: Vec<(usize, usize, &Context)> = Vec::new();
    for (context, origin) in parsed.contexts() {
        let (start, end) = (origin.span.start, origin.span.end);
        if references.iter().any(|(s, e, _)| *s <= start && end <= *e) {
            continue;
        }
        references.retain(|(s, e, _)| !(start <= *s && *e <= end));
        references.push((start, end, context));
    }
    references.sort_by_key(|(start, _, _)| *start);
    let mut constant = String::with_capacity(expression.len());
    let mut at = 0;
    for (start, end, context) in references {
        constant.push_str(&expression[at..start]);
        constant.push_str(&literal(&resolve(context, contexts).map_err(error)?));
        at = end;
    }
    constant.push_str(&expression[at..]);
    let evaluation = Expr::parse(&constant)
        .map_err(|e| error(e.to_string()))?
        .consteval()
        .ok_or_else(|| error("cannot be evaluated before the job starts (run-local knows needs, inputs, vars and github here)".into()))?;
    evaluation.try_into().map_err(|()| error("gives a number JSON cannot hold".into()))
}

/// The value a context reference names; a missing field is null, as in GitHub.
fn resolve(context: &Context, contexts: &Json) -> Result<Json, String> {
    let mut parts = context.parts.iter();
    let Some(Expr::Identifier(root)) = parts.next().map(|p| &p.inner) else {
        return Err("a context must start with a name (needs, inputs, vars, github)".into());
    };
    let root_name = root.as_str().to_ascii_lowercase();
    let mut current = contexts.get(&root_name).cloned().ok_or_else(|| format!("the context {root_name:?} is not known when a matrix is expanded"))?;
    for part in parts {
        let key = match &part.inner {
            Expr::Identifier(name) => Json::String(name.as_str().to_owned()),
            Expr::Index(index) => match &index.inner {
                Expr::Literal(Literal::String(s)) => Json::String(s.to_string()),
                Expr::Literal(Literal::Number(n)) => Json::from(*n),
                Expr::Context(inner) => resolve(inner, contexts)?,
                _ => return Err("an index must be a string, a number or a context".into()),
            },
            _ => return Err("`*` filters are not supported in a matrix expression".into()),
        };
        current = match (&current, &key) {
            // Property names are case-insensitive, as in GitHub.
            (Json::Object(object), Json::String(name)) => {
                object.iter().find(|(field, _)| field.eq_ignore_ascii_case(name)).map_or(Json::Null, |(_, value)| value.clone())
            }
            (Json::Array(items), Json::Number(n)) => n.as_f64().and_then(|n| items.get(n as usize)).cloned().unwrap_or(Json::Null),
            _ => Json::Null,
        };
    }
    Ok(current)
}

/// `value` as expression text that evaluates to it.
fn literal(value: &Json) -> String {
    let quoted = |text: &str| format!("'{}'", text.replace('\'', "''"));
    match value {
        Json::Null => "null".into(),
        Json::Bool(b) => b.to_string(),
        Json::Number(n) => n.to_string(),
        Json::String(s) => quoted(s),
        Json::Array(_) | Json::Object(_) => format!("fromJSON({})", quoted(&value.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contexts() -> Json {
        serde_json::json!({
            "needs": {"prepare": {"result": "success", "outputs": {"matrix": "{\"os\":[\"linux\",\"bsd\"],\"n\":[1]}", "key": "os", "list": "[\"a\",\"b\",\"c\"]"}}},
            "inputs": {"level": "high"},
            "vars": {},
            "github": {"event_name": "push", "repository": "acme/app"},
        })
    }

    #[test]
    fn expressions_evaluate_against_the_contexts_known_before_a_job_starts() {
        let table: &[(&str, Json)] = &[
            ("fromJSON(needs.prepare.outputs.matrix)", serde_json::json!({"os": ["linux", "bsd"], "n": [1]})),
            ("fromJSON(needs.prepare.outputs.list)", serde_json::json!(["a", "b", "c"])),
            ("fromJSON('[1,2]')", serde_json::json!([1, 2])),
            ("needs.prepare.outputs.key", serde_json::json!("os")),
            ("needs['prepare'].outputs['KEY']", serde_json::json!("os")),
            ("NEEDS.prepare.result == 'success'", serde_json::json!(true)),
            ("format('{0}-{1}', inputs.level, github.repository)", serde_json::json!("high-acme/app")),
            ("vars.MISSING || 'fallback'", serde_json::json!("fallback")),
            ("needs.nobody.outputs.x", Json::Null),
            ("contains(fromJSON(needs.prepare.outputs.list), 'b')", serde_json::json!(true)),
            ("'it''s'", serde_json::json!("it's")),
        ];
        for (expression, want) in table {
            assert_eq!(&evaluate(expression, &contexts()).unwrap_or_else(|e| panic!("{e}")), want, "{expression}");
        }
    }

    #[test]
    fn what_cannot_be_known_says_so() {
        let table = [
            ("steps.a.outputs.b", "\"steps\" is not known"),
            ("hashFiles('x')", "cannot be evaluated before the job starts"),
            ("fromJSON(", "${{ fromJSON( }}"),
        ];
        for (expression, want) in table {
            let error = evaluate(expression, &contexts()).unwrap_err().to_string();
            assert!(error.contains(want), "{expression}: {error}");
        }
    }

    #[test]
    fn values_keep_their_shape_and_text_is_interpolated() {
        let value: Value = serde_yaml_ng::from_str(
            "whole: ${{ fromJSON(needs.prepare.outputs.list) }}\n${{ needs.prepare.outputs.key }}: [x]\ntext: 'level ${{ inputs.level }} of ${{ github.repository }}'\nplain: [1, true]\n",
        )
        .unwrap();
        assert!(has_expression(&value));
        let evaluated = evaluate_value(&value, &contexts()).unwrap();
        let want: Value = serde_yaml_ng::from_str("whole: [a, b, c]\nos: [x]\ntext: level high of acme/app\nplain: [1, true]\n").unwrap();
        assert_eq!(evaluated, want);
        assert!(!has_expression(&evaluated));
    }
}
