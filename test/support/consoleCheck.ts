// The console as an operator meets it on a running worker (from the installed package or the image):
// the sign-in page, the stylesheet and script it links, a sign-in with the admin token, the overview.
import { expect } from 'vitest';

export async function checkConsole(base: string, adminToken: string): Promise<void> {
  const signInPage = await fetch(`${base}/console/sign-in`);
  expect(signInPage.status).toBe(200);
  const html = await signInPage.text();
  const css = html.match(/<link rel="stylesheet" href="([^"]+)">/)?.[1];
  const js = html.match(/<script src="([^"]+)"/)?.[1];
  expect(css, 'the sign-in page links its stylesheet').toMatch(/^\/console\/assets\/console-\w+\.css$/);
  expect(js, 'the sign-in page links its script').toMatch(/^\/console\/assets\/console-\w+\.js$/);
  for (const [asset, type] of [[css!, 'text/css'], [js!, 'text/javascript']] as const) {
    const res = await fetch(`${base}${asset}`);
    expect(res.status, asset).toBe(200);
    expect(res.headers.get('content-type'), asset).toContain(type);
    expect((await res.text()).length, asset).toBeGreaterThan(100);
  }
  const signedIn = await fetch(`${base}/console/sign-in`, {
    method: 'POST',
    body: new URLSearchParams({ operator: 'release-check', token: adminToken }),
    redirect: 'manual',
  });
  expect(signedIn.status).toBe(303);
  const cookie = signedIn.headers.get('set-cookie')!.split(';')[0]!;
  const overview = await fetch(`${base}/console/`, { headers: { cookie } });
  expect(overview.status).toBe(200);
  expect(await overview.text()).toContain(css!);
}
