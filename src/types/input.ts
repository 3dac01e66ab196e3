// What any input is checked against before anything is written (invariant 11), whatever kind it asks
// for: text PostgreSQL can store, ids of a bounded length, and zod's issues as a ValidationError.
import type { z } from 'zod';
import { ValidationError } from './errors.ts';

/** Stripe's largest amount for a single charge, in minor units (8 digits). */
export const MAX_AMOUNT = 99_999_999;
export const MAX_ID_LENGTH = 255;

/**
 * PostgreSQL's text and jsonb cannot hold U+0000, and half a surrogate pair is no text at all (the driver
 * would store U+FFFD in its place, another id than the caller's). Either is refused here, before any
 * statement: one failing inside the caller's transaction would abort it.
 */
export const isStorableText = (s: string): boolean => !s.includes('\0') && s.isWellFormed();
export const UNSTORABLE = 'must not contain U+0000 or half a surrogate pair';
/** Text from elsewhere (a handler's error, cut to length) as PostgreSQL can store it: U+0000 and each half
 * of a surrogate pair become U+FFFD, where refusing it would leave its failure unrecorded. */
export const storableText = (s: string): string => s.replaceAll('\0', '\ufffd').toWellFormed();

/** The most of a reason (an error's message, what a check said) kept on an operation, its timeline and
 * its settlement event: an application's code can throw a message of any length, once per attempt. */
export const MAX_REASON_LENGTH = 2000;
/** A reason as stored: storable, and cut to MAX_REASON_LENGTH characters, saying how many were left out. */
export const storableReason = (s: string): string =>
  storableText(s.length > MAX_REASON_LENGTH ? `${s.slice(0, MAX_REASON_LENGTH)}… (${s.length - MAX_REASON_LENGTH} more characters)` : s);

/** Whatever an application's code threw or returned, as text: String() of it, unless even that throws (an
 * object with no prototype, a toString that throws). */
export function textOf(value: unknown): string {
  try {
    return String(value);
  } catch {
    return Object.prototype.toString.call(value);
  }
}

/** What a thrown value says: its message when that is text (an Error's may be anything), else the value
 * as text (textOf). */
export function messageOf(thrown: unknown): string {
  const message = typeof thrown === 'object' && thrown !== null ? (thrown as { message?: unknown }).message : undefined;
  return typeof message === 'string' ? message : textOf(thrown);
}

/** U+0000, or a lone surrogate (JSON.stringify escapes only those: a whole pair is written as is),
 * escaped in JSON text; an escaped backslash before "u0000" is not one. */
const UNSTORABLE_ESCAPE = /(?<!\\)((?:\\\\)*)\\u(?:0000|d[89a-f][0-9a-f]{2})/g;

/** PostgreSQL's text and jsonb cannot hold U+0000 or half a surrogate pair (a string cut through an
 * emoji), yet an effect's result or an error's message may: it is stored as U+FFFD (what a decoder puts
 * for what it could not keep). Refusing it instead would leave an effect that ran with an outcome that
 * can never be recorded, to be executed again and again. */
export const storableJson = (json: string): string => json.replace(UNSTORABLE_ESCAPE, '$1\\ufffd');

/** Where in a JSON value (keys and strings, nested) the first unstorable text is: 'a.b[2]', or undefined. */
export function unstorableAt(value: unknown, path: string): string | undefined {
  if (typeof value === 'string') return isStorableText(value) ? undefined : path;
  if (Array.isArray(value)) {
    for (let i = 0; i < value.length; i++) {
      const at = unstorableAt(value[i], `${path}[${i}]`);
      if (at) return at;
    }
    return undefined;
  }
  if (value === null || typeof value !== 'object') return undefined;
  for (const [k, v] of Object.entries(value)) {
    // The key itself goes unnamed when it cannot be stored: it is the bad part.
    if (!isStorableText(k)) return `${path} (a key)`;
    const at = unstorableAt(v, `${path}.${k}`);
    if (at) return at;
  }
  return undefined;
}

/** The first issue zod found, as a ValidationError naming its field. A record's bad key is named with
 * the key's own issue, and by the record alone when the key itself cannot be stored (nor shown). */
export function validationErrorOf(issue: z.core.$ZodIssue): ValidationError {
  if (issue.code === 'unrecognized_keys') return new ValidationError(issue.keys.join(', '), 'unknown field');
  const path = issue.path.map(String);
  if (issue.code === 'invalid_key') {
    const named = isStorableText(path.at(-1) ?? '') ? path : path.slice(0, -1);
    return new ValidationError(named.join('.') || 'input', issue.issues[0]?.message ?? issue.message);
  }
  return new ValidationError(path.join('.') || 'input', issue.message);
}

/** `input` parsed by `schema`, or the ValidationError naming its first bad field. */
export function parseWith<T>(schema: z.ZodType<T>, input: unknown): T {
  const result = schema.safeParse(input);
  if (result.success) return result.data;
  throw validationErrorOf(result.error.issues[0]!);
}
