// The console's drift page shows a bounded number of findings: a report of a disaster may hold one per
// operation of the month, and the page is one string in a replica's memory.
import { describe, expect, it } from 'vitest';
import { driftPage } from '../../src/console/views/pages.ts';

describe('the drift page', () => {
  it('shows the first 500 findings and says how many more the CLI lists', () => {
    const drift = Array.from({ length: 501 }, (_, i) => ({ kind: 'missing_charge', operationId: null, chargeIds: [`pi_${i}`], detail: 'charge not found' }));
    const page = driftPage({ hours: 720, report: { since: '2026-11-07T00:00:00.000Z', operations: 501, charges: 0, drift } }).toString();
    expect(page.match(/<tr><td>/g)).toHaveLength(500);
    expect(page).toContain('pi_499');
    expect(page).not.toContain('pi_500');
    expect(page).toContain('501 findings');
    expect(page).toContain('<code>outboxd reconcile --report --since 720h --json</code> lists all of them, 1 more.');
  });
});
