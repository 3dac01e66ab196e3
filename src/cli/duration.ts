import { InvalidArgumentError } from 'commander';

const UNITS: Record<string, number> = { s: 1, m: 60, h: 3600, d: 86400 };

/** "90s", "10m", "2h", "7d" → seconds. */
export function parseDuration(text: string): number {
  const m = /^(\d+)([smhd])$/.exec(text.trim());
  if (!m) throw new InvalidArgumentError('a duration like 90s, 10m, 2h or 7d');
  return Number(m[1]) * UNITS[m[2]!]!;
}
